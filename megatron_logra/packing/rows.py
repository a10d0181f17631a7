"""A packed row's tensors: per-token values of several sequences side by side, and back.

A :class:`RowLayout` says where each sequence of one microbatch row sits (its start, its real
length, the span it occupies with its padding); it gives the cumulative sequence lengths of
Megatron's ``PackedSeqParams`` (``thd`` format: ``cu_seqlens`` of the real lengths and
``cu_seqlens_padded`` of the spans), each sequence's own positions (restarting at 0), and the
index that gathers a row's per-token values into a ``[sequences, longest]`` block -- the layout
every loss and metric of the unpacked path takes, so packing changes no loss formula.

Under context parallelism (:meth:`RowLayout.on_cp_rank`) every sequence of the row is split as
an unpacked sequence is (:mod:`megatron_logra.context_parallel`: ``2 * cp`` chunks of its span,
CP rank ``r`` holding chunks ``r`` and ``2 * cp - 1 - r``), so a rank's local row is the
concatenation of its two chunks of each sequence, ``T / cp`` tokens -- Megatron's ``thd``
layout under CP, which its rotary embedding slices the same way. The layout then also gives the
row positions a rank holds, the per-sequence split of ``[N, L]`` tensors that matches them, and
a gather index of the local row; ``cu_seqlens`` stay the whole row's (Megatron's convention).

Torch only. Shape names: T = tokens of the row, N = sequences in it, L = the longest of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_logra.context_parallel import held_positions
from megatron_logra.packing.plan import Pack, span_starts


@dataclass(frozen=True)
class RowLayout:
    """Where the sequences of one packed row are.

    Attributes:
        lengths: real tokens of each sequence, in row order.
        spans: tokens each occupies (real + padding); they add up to ``row_length``. A row with
            no sequence (a pack left empty) has one span of padding and a real length of 0.
        row_length: T.
        cp_rank, cp_size: the context-parallel rank whose share of the row this describes
            (every span a multiple of ``2 * cp_size``); ``cp_size=1``: the whole row.
    """

    lengths: tuple[int, ...]
    spans: tuple[int, ...]
    row_length: int
    cp_rank: int = 0
    cp_size: int = 1

    def __post_init__(self) -> None:
        if len(self.lengths) != len(self.spans) or sum(self.spans) != self.row_length:
            raise ValueError(f"spans {self.spans} must add up to row_length {self.row_length} "
                             f"with one span per length {self.lengths}")
        if any(length > span for length, span in zip(self.lengths, self.spans, strict=True)):
            raise ValueError(f"a sequence is longer than its span: {self.lengths} vs {self.spans}")
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"cp_rank={self.cp_rank} must be in [0, cp_size={self.cp_size})")
        if self.cp_size > 1 and any(span % (2 * self.cp_size) for span in self.spans):
            raise ValueError(
                f"spans {self.spans} cannot each be split into 2 * cp = {2 * self.cp_size} "
                "equal chunks; plan the row with the context-parallel sequence multiple "
                "(megatron_logra.packing.plan.layout_multiples)")

    @classmethod
    def of(cls, pack: Pack) -> RowLayout:
        if not pack.indices:
            return cls(lengths=(0,), spans=(pack.row_length,), row_length=pack.row_length)
        return cls(lengths=pack.lengths, spans=pack.spans, row_length=pack.row_length)

    def on_cp_rank(self, cp_rank: int, cp_size: int) -> RowLayout:
        """This row as CP rank ``cp_rank`` of ``cp_size`` holds it."""
        return dataclasses.replace(self, cp_rank=cp_rank, cp_size=cp_size)

    @property
    def local_length(self) -> int:
        """Tokens of the row this rank holds (``T / cp``)."""
        return self.row_length // self.cp_size

    @property
    def starts(self) -> tuple[int, ...]:
        return span_starts(self.spans)

    @property
    def sequences(self) -> int:
        """Sequences with at least one real token."""
        return sum(1 for length in self.lengths if length)

    @property
    def longest(self) -> int:
        return max(self.lengths)

    def cu_seqlens(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """int32 ``[N + 1]``: cumulative real lengths."""
        return _cumulative(self.lengths, device)

    def cu_seqlens_padded(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """int32 ``[N + 1]``: cumulative spans (where each sequence starts in the row)."""
        return _cumulative(self.spans, device)

    def position_ids(self) -> torch.Tensor:
        """int64 ``[1, T]``: every sequence's positions from 0, padding at position 0 (within
        the learned-position table whatever the row's length)."""
        parts = []
        for length, span in zip(self.lengths, self.spans, strict=True):
            parts += [torch.arange(length, dtype=torch.int64),
                      torch.zeros(span - length, dtype=torch.int64)]
        return torch.cat(parts)[None]

    def held_positions(self, cp_rank: int | None = None) -> torch.Tensor:
        """int64 ``[T / cp]``: the row positions CP rank ``cp_rank`` (default: this layout's)
        holds, in its local order (each sequence's two chunks, sequence after sequence)."""
        rank = self.cp_rank if cp_rank is None else cp_rank
        return torch.cat([start + held_positions(span, rank, self.cp_size)
                          for start, span in zip(self.starts, self.spans, strict=True)])

    def rank_major_positions(self) -> torch.Tensor:
        """int64 ``[T]``: the row position of each entry of every CP rank's local row
        concatenated in rank order (what an all-gather of the local rows returns)."""
        return torch.cat([self.held_positions(rank) for rank in range(self.cp_size)])

    def split_row(self, row: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole row's tensor (``T`` along ``dim``)."""
        if self.cp_size == 1:
            return row
        if row.shape[dim] != self.row_length:
            raise ValueError(f"a packed row has {self.row_length} positions along dim {dim}, got "
                             f"{tuple(row.shape)}")
        return row.index_select(dim, self.held_positions().to(row.device))

    def sequence_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, held)``, both ``[N, W]`` (W: the longest local span): the position
        within its sequence of each of this rank's tokens, and whether the column exists."""
        width = max(span // self.cp_size for span in self.spans)
        positions = torch.zeros(len(self.spans), width, dtype=torch.int64)
        held = torch.zeros(len(self.spans), width, dtype=torch.bool)
        for i, span in enumerate(self.spans):
            mine = held_positions(span, self.cp_rank, self.cp_size)
            positions[i, :len(mine)], held[i, :len(mine)] = mine, True
        return positions, held

    def split_per_sequence(self, values: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
        """``[N, L, ...]`` per-sequence values (an unpacked microbatch's layout) -> ``[N, W,
        ...]``: each sequence's values at the positions this rank holds, in the order of
        :meth:`gather_index`; ``fill`` past each sequence's length."""
        if self.cp_size == 1:
            return values
        positions, held = self.sequence_positions()
        valid = held & (positions < torch.tensor(self.lengths)[:, None])
        positions, valid = positions.to(values.device), valid.to(values.device)
        index = torch.where(valid, positions, 0).clamp(max=values.shape[1] - 1)
        index = index.reshape(*index.shape, *([1] * (values.dim() - 2))).expand(
            *index.shape, *values.shape[2:])
        gathered = values.gather(1, index)
        mask = valid.reshape(*valid.shape, *([1] * (values.dim() - 2)))
        return torch.where(mask, gathered, torch.as_tensor(fill, dtype=values.dtype,
                                                           device=values.device))

    def gather_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index, valid)``, both ``[N, L]``: ``row[0, index]`` puts sequence i's token j at
        ``[i, j]``; ``valid`` is False past each sequence's length (where index is 0).

        Under context parallelism ``[N, W]`` into this rank's local row: column k of sequence
        i is its k-th local token (the order of :meth:`split_per_sequence`)."""
        if self.cp_size > 1:
            positions, held = self.sequence_positions()
            valid = held & (positions < torch.tensor(self.lengths)[:, None])
            local_starts = torch.tensor(self.starts, dtype=torch.int64)[:, None] // self.cp_size
            offsets = torch.arange(positions.shape[1], dtype=torch.int64)[None, :]
            return torch.where(valid, local_starts + offsets, 0), valid
        width = max(self.longest, 1)
        offsets = torch.arange(width, dtype=torch.int64)[None, :]
        starts = torch.tensor(self.starts, dtype=torch.int64)[:, None]
        lengths = torch.tensor(self.lengths, dtype=torch.int64)[:, None]
        valid = offsets < lengths
        return torch.where(valid, starts + offsets, 0), valid


def _cumulative(values: Sequence[int], device: torch.device | str) -> torch.Tensor:
    out = [0]
    for value in values:
        out.append(out[-1] + value)
    return torch.tensor(out, dtype=torch.int32, device=device)


def pack_row(values: Sequence[torch.Tensor], layout: RowLayout, fill: float | int | bool,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[1, T]``: each sequence's 1-D values at its place in the row, ``fill`` elsewhere
    (``dtype``: the values' by default)."""
    placed = [(start, length) for start, length in zip(layout.starts, layout.lengths,
                                                         strict=True) if length]
    if len(values) != len(placed):
        raise ValueError(f"{len(values)} sequences for a row of {len(placed)}")
    if dtype is None:
        dtype = values[0].dtype if values else torch.int64
    row = torch.full((1, layout.row_length), fill, dtype=dtype)
    for value, (start, length) in zip(values, placed, strict=True):
        if value.shape != (length,):
            raise ValueError(f"a sequence of {length} tokens got values shaped "
                             f"{tuple(value.shape)}")
        row[0, start:start + length] = value
    return row


def unpack_row(row: torch.Tensor, layout: RowLayout, fill: float | int | bool = 0,
               index: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``[1, T, ...]`` (or ``[1, T]``) row values -> ``[N, L, ...]`` per sequence, ``fill``
    past each sequence's end (under context parallelism this rank's ``[1, T / cp, ...]`` ->
    ``[N, W, ...]``, see :meth:`RowLayout.gather_index`). Differentiable (a gather). ``index``: a precomputed
    :meth:`RowLayout.gather_index` on the row's device."""
    if row.shape[:2] != (1, layout.local_length):
        raise ValueError(f"a packed row is [1, {layout.local_length}, ...], got "
                         f"{tuple(row.shape)}")
    positions, valid = index if index is not None else layout.gather_index()
    positions, valid = positions.to(row.device), valid.to(row.device)
    gathered = row[0][positions]
    mask = valid.reshape(*valid.shape, *([1] * (gathered.dim() - 2)))
    return torch.where(mask, gathered, torch.as_tensor(fill, dtype=row.dtype, device=row.device))
