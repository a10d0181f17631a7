"""Exact causal attention of a context-parallel rank's two sequence chunks: all-gather of K/V.

Under context parallelism each rank holds chunks ``r`` and ``2 cp - 1 - r`` of every sequence
(:mod:`megatron_logra.context_parallel`). Its queries need the keys and values of every earlier
position, so the keys and values of the whole sequence are all-gathered over the CP group (one
collective for both, in sequence order; with grouped-query attention they are the small part of
the layer), and each local chunk ``c`` of ``L`` queries attends to the first ``(c + 1) L`` keys
under a causal mask aligned to the last key -- the same softmax over the same keys as the
unsplit sequence, so the output is exact (TE's ``all_gather`` mode and Llama 3's training do
the same). Work is balanced: chunk ``c`` and chunk ``2 cp - 1 - c`` together cover
``2 cp + 1`` chunk blocks on every rank.

Backward: SDPA's own backward per chunk; the gathered keys' and values' gradients (each rank's
queries contribute to every earlier position) are reduce-scattered back over the CP group to
the ranks that hold those positions. Forward-mode AD (the KL probe): the tangents of the local
keys and values are gathered the same way, and each chunk goes through the tangent rule of
:mod:`megatron_logra.mcore.models.sdpa_forward_ad`.

Shapes: Megatron's ``[s_local, b, heads, head_dim]`` in, SDPA's ``[b, heads, s_local,
head_dim]`` out.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_logra.context_parallel import held_chunks, to_global_order, to_rank_major_order
from megatron_logra.mcore.models.sdpa_forward_ad import attention
from megatron_logra.mcore.tensor_parallel.seq_collectives import (
    all_gather_first_dim,
    reduce_scatter_first_dim,
)


class _GatherSequence(torch.autograd.Function):
    """``[s_local, ...]`` per CP rank -> ``[s, ...]`` in sequence order on every rank; backward
    sums each position's gradient over the ranks and returns this rank's positions."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup,
                cp_size: int) -> torch.Tensor:
        ctx.group, ctx.cp_size = group, cp_size
        return to_global_order(all_gather_first_dim(local, group), cp_size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rank_major = to_rank_major_order(grad, ctx.cp_size)
        return reduce_scatter_first_dim(rank_major, ctx.group), None, None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, *_: Any) -> torch.Tensor:
        return to_global_order(all_gather_first_dim(tangent, ctx.group), ctx.cp_size)


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    scale: float,
) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence's keys and values.

    Args:
        query: ``[s_local, b, heads, d]``, this rank's two chunks (``s_local = 2 L``).
        key, value: ``[s_local, b, kv_heads, d]`` of the same positions.
        group: the context-parallel group (Megatron's ``pg_collection.cp``).
        scale: the softmax scale.

    Returns:
        ``[b, heads, s_local, d_v]``.
    """
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    s_local = query.shape[0]
    if s_local % 2 or key.shape[0] != s_local:
        raise ValueError(
            f"context-parallel attention needs this rank's two equal chunks of queries and "
            f"keys; got {s_local} queries and {key.shape[0]} keys"
        )
    chunk = s_local // 2
    key_dim = key.shape[-1]
    both = _GatherSequence.apply(torch.cat([key, value], dim=-1), group, cp_size)
    keys, values = (t.permute(1, 2, 0, 3) for t in both.split(
        [key_dim, value.shape[-1]], dim=-1))
    queries = query.permute(1, 2, 0, 3)
    outputs = []
    for half, index in enumerate(held_chunks(cp_rank, cp_size)):
        visible = (index + 1) * chunk
        outputs.append(attention(
            queries[:, :, half * chunk:(half + 1) * chunk], keys[:, :, :visible],
            values[:, :, :visible], None, True, scale, bottom_right=True,
        ))
    return torch.cat(outputs, dim=2)
