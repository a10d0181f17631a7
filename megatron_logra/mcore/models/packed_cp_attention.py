"""Exact causal attention of a packed row split over context parallelism (``thd`` under CP).

Under context parallelism a packed row is split sequence by sequence
(:meth:`megatron_logra.packing.RowLayout.held_positions`): each sequence's span is cut into
``2 cp`` chunks and CP rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of every sequence, its
local row their concatenation, sequence after sequence. Megatron's ``PackedSeqParams`` keep the
whole row's ``cu_seqlens`` (its rotary embedding slices each sequence's positions the same way).

The keys and values of the local rows are all-gathered over the CP group in one collective and
put back in row order; then each sequence's two local query chunks attend causally, aligned to
the last key, to that sequence's first ``(c + 1) L_i`` keys (``c``: the chunk's index, ``L_i``
its length) -- the softmax of the unsplit sequence over the same keys, so the output is exact,
as :mod:`.cp_attention` is for unpacked sequences. A sequence's real tokens precede its padding,
so they never see it; padding queries see earlier real tokens and padding (finite, never read).

Backward: SDPA's per chunk; the gathered keys' and values' gradients go back to the ranks that
hold those positions by the inverse reorder and a reduce-scatter over the CP group. Forward-mode
AD: the local tangents are gathered the same way and each chunk goes through the SDPA tangent
rule (:mod:`.sdpa_forward_ad`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_logra.context_parallel import held_chunks
from megatron_logra.mcore.models.sdpa_forward_ad import attention
from megatron_logra.mcore.tensor_parallel.seq_collectives import (
    all_gather_first_dim,
    reduce_scatter_first_dim,
)
from megatron_logra.packing.rows import RowLayout


class _GatherRow(torch.autograd.Function):
    """``[T / cp, ...]`` local rows -> ``[T, ...]`` in row order on every CP rank (``order``:
    the rank-major entry of each row position); backward sums each position's gradient over
    the ranks and returns this rank's positions."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup,
                order: torch.Tensor, rank_major: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        ctx.save_for_backward(rank_major)
        ctx.order = order
        return all_gather_first_dim(local, group).index_select(0, order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (rank_major,) = ctx.saved_tensors
        return (reduce_scatter_first_dim(grad.index_select(0, rank_major).contiguous(),
                                         ctx.group), None, None, None)

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, *_: Any) -> torch.Tensor:
        return all_gather_first_dim(tangent, ctx.group).index_select(0, ctx.order)


def _row_layout(params: PackedSeqParams) -> RowLayout:
    """The whole row's layout from its ``thd`` parameters (real lengths and spans)."""
    real = params.cu_seqlens_q.tolist()
    padded = (params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None
              else params.cu_seqlens_q).tolist()
    return RowLayout(lengths=tuple(b - a for a, b in zip(real, real[1:], strict=False)),
                     spans=tuple(b - a for a, b in zip(padded, padded[1:], strict=False)),
                     row_length=padded[-1])


def packed_context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    params: PackedSeqParams,
    *,
    group: dist.ProcessGroup,
    scale: float,
) -> torch.Tensor:
    """Causal attention of this CP rank's part of a packed row over each sequence's keys.

    Args:
        query: ``[T / cp, heads, d]``, this rank's local row (``thd``).
        key, value: ``[T / cp, kv_heads, d]`` of the same positions.
        params: the whole row's ``thd`` parameters (``cu_seqlens_q_padded``: each sequence's
            span, a multiple of ``2 cp``).
        group: the context-parallel group.
        scale: the softmax scale.

    Returns:
        ``[T / cp, 1, heads * d_v]``.
    """
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    local, heads, _ = query.shape
    layout = _row_layout(params)
    if layout.row_length != cp_size * local:
        raise ValueError(
            f"a packed row of {layout.row_length} tokens split over cp={cp_size} ranks gives "
            f"each {layout.row_length // cp_size}, got {local} queries"
        )
    # (RowLayout refuses a span that does not split into 2 * cp chunks.)
    rank_major = layout.on_cp_rank(cp_rank, cp_size).rank_major_positions().to(query.device)
    order = torch.argsort(rank_major)
    key_dim = key.shape[-1]
    both = _GatherRow.apply(torch.cat([key, value], dim=-1), group, order, rank_major)
    # [T, h, d] -> [1, h, T, d], SDPA's layout.
    keys, values = (t.permute(1, 0, 2)[None] for t in both.split(
        [key_dim, value.shape[-1]], dim=-1))
    queries = query.permute(1, 0, 2)[None]
    outputs, offset = [], 0
    for start, span in zip(layout.starts, layout.spans, strict=True):
        chunk = span // (2 * cp_size)
        for half, index in enumerate(held_chunks(cp_rank, cp_size)):
            visible = slice(start, start + (index + 1) * chunk)
            mine = slice(offset + half * chunk, offset + (half + 1) * chunk)
            outputs.append(attention(queries[:, :, mine], keys[:, :, visible],
                                     values[:, :, visible], None, True, scale,
                                     bottom_right=True))
        offset += 2 * chunk
    context = torch.cat(outputs, dim=2)  # [1, h, T / cp, d_v]
    return context[0].permute(1, 0, 2).reshape(local, 1, heads * context.shape[-1])
