"""The context-parallel sequence split: which positions of a sequence each CP rank holds.

Megatron's load-balanced scheme for causal attention: a sequence of ``s`` positions is cut into
``2 * cp`` equal chunks and CP rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, in that
order. Under a causal mask chunk ``c`` attends to ``c + 1`` chunks of keys, so every rank's pair
costs the same ``2 * cp + 1`` chunk blocks. Megatron's rotary embedding slices its positions the
same way (``get_pos_emb_on_this_cp_rank``); every per-token tensor a forward step reads (tokens,
labels, positions, loss and response masks, log-probs) is split by :func:`split_batch` here, so
that a rank's tokens, labels and positions stay aligned.

A *rank-major* tensor is the concatenation of every rank's local sequence in rank order (what an
all-gather returns); :func:`to_global_order` and :func:`to_rank_major_order` convert between it
and the sequence order. Pure torch; collectives take an explicit group.

A packed microbatch (one ``[1, T]`` row of several sequences, its ``layout`` a
:class:`megatron_logra.packing.RowLayout`) is split per sequence: every sequence of the row in
``2 * cp`` chunks of its span, a rank's local row its two chunks of each sequence in turn
(Megatron's ``thd`` layout under CP); :func:`split_batch` does that from the layout, and
:func:`gather_packed_row` is the inverse gather.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch
import torch.distributed as dist

Batch = TypeVar("Batch")


def held_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp_size``) that CP rank ``cp_rank`` holds, in its local order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must be in [0, cp_size={cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _chunk_length(length: int, cp_size: int) -> int:
    if length % (2 * cp_size):
        raise ValueError(
            f"a sequence of {length} positions cannot be split into 2 * cp = {2 * cp_size} "
            "equal chunks; pad it to a multiple of 2 * parallel.cp (model.seq_length is checked)"
        )
    return length // (2 * cp_size)


def held_positions(length: int, cp_rank: int, cp_size: int,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 ``[length / cp_size]``: the sequence positions CP rank ``cp_rank`` holds, in order."""
    chunk = _chunk_length(length, cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in held_chunks(cp_rank, cp_size)])


def split_sequence(tensor: torch.Tensor, cp_rank: int, cp_size: int,
                   dim: int = 1) -> torch.Tensor:
    """This rank's positions of ``tensor`` along its sequence dimension ``dim``."""
    if cp_size == 1:
        return tensor
    chunk = _chunk_length(tensor.shape[dim], cp_size)
    return torch.cat([tensor.narrow(dim, c * chunk, chunk)
                      for c in held_chunks(cp_rank, cp_size)], dim=dim)


def _chunk_permutation(cp_size: int) -> list[int]:
    """``perm[c]``: where global chunk ``c`` sits in the rank-major order."""
    perm = [0] * (2 * cp_size)
    for rank in range(cp_size):
        for half, chunk in enumerate(held_chunks(rank, cp_size)):
            perm[chunk] = 2 * rank + half
    return perm


def to_global_order(rank_major: torch.Tensor, cp_size: int, dim: int = 0) -> torch.Tensor:
    """Every rank's local sequence, concatenated in rank order -> the sequence in order."""
    chunk = _chunk_length(rank_major.shape[dim], cp_size)
    return torch.cat([rank_major.narrow(dim, slot * chunk, chunk)
                      for slot in _chunk_permutation(cp_size)], dim=dim)


def to_rank_major_order(ordered: torch.Tensor, cp_size: int, dim: int = 0) -> torch.Tensor:
    """The inverse of :func:`to_global_order`."""
    chunk = _chunk_length(ordered.shape[dim], cp_size)
    perm = _chunk_permutation(cp_size)
    inverse = sorted(range(2 * cp_size), key=perm.__getitem__)
    return torch.cat([ordered.narrow(dim, c * chunk, chunk) for c in inverse], dim=dim)


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup, cp_size: int,
                    dim: int = 1) -> torch.Tensor:
    """The whole sequence on every CP rank from each rank's positions (no autograd)."""
    if cp_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return to_global_order(torch.cat(parts, dim=dim), cp_size, dim=dim)


def gather_packed_row(local: torch.Tensor, layout: Any, group: dist.ProcessGroup,
                      dim: int = 1) -> torch.Tensor:
    """The whole packed row on every CP rank from each rank's local row (no autograd);
    ``layout``: the row's ``RowLayout`` (its ``cp_size``)."""
    if layout.cp_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(layout.cp_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    order = torch.argsort(layout.rank_major_positions()).to(local.device)
    return torch.cat(parts, dim=dim).index_select(dim, order)


def split_batch(batch: Batch, cp_rank: int, cp_size: int) -> Batch:
    """A dataclass microbatch with every per-token tensor field (``[b, s, ...]``: two or more
    dimensions) cut to this rank's positions; per-sequence fields (``[b]``) and None stay.

    A packed microbatch (a ``layout`` field that is not None) is split sequence by sequence:
    its row fields by the layout's row positions, the fields its class names in
    ``per_sequence_fields`` (``[N, L]`` per sequence) to the same tokens of each sequence,
    ``gather`` (a gather index) recomputed for the local row, ``layout`` set to this rank's."""
    if cp_size == 1:
        return batch
    layout = getattr(batch, "layout", None)
    if layout is not None:
        return _split_packed(batch, layout.on_cp_rank(cp_rank, cp_size))
    changes: dict[str, Any] = {}
    for item in dataclasses.fields(batch):
        value = getattr(batch, item.name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            changes[item.name] = split_sequence(value, cp_rank, cp_size, dim=1)
    return dataclasses.replace(batch, **changes)


def _split_packed(batch: Batch, layout: Any) -> Batch:
    per_sequence = getattr(batch, "per_sequence_fields", ())
    changes: dict[str, Any] = {"layout": layout}
    for item in dataclasses.fields(batch):
        value = getattr(batch, item.name)
        if item.name == "gather" and value is not None:
            changes[item.name] = tuple(t.to(value[0].device) for t in layout.gather_index())
        elif not (isinstance(value, torch.Tensor) and value.dim() >= 2):
            continue
        elif item.name in per_sequence:
            # Outside the sequence's length nothing counts (False / 0 past it, as unpacked).
            changes[item.name] = layout.split_per_sequence(value, fill=False if value.dtype
                                                           == torch.bool else 0)
        else:
            changes[item.name] = layout.split_row(value, dim=1)
    return dataclasses.replace(batch, **changes)
