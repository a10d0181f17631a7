"""A packed row's tensors: per-token values of several sequences side by side, and back.

A :class:`RowLayout` says where each sequence of one microbatch row sits (its start, its real
length, the span it occupies with its padding); it gives the cumulative sequence lengths of
Megatron's ``PackedSeqParams`` (``thd`` format: ``cu_seqlens`` of the real lengths and
``cu_seqlens_padded`` of the spans), each sequence's own positions (restarting at 0), and the
index that gathers a row's per-token values into a ``[sequences, longest]`` block -- the layout
every loss and metric of the unpacked path takes, so packing changes no loss formula.

Torch only. Shape names: T = tokens of the row, N = sequences in it, L = the longest of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_logra.packing.plan import Pack


@dataclass(frozen=True)
class RowLayout:
    """Where the sequences of one packed row are.

    Attributes:
        lengths: real tokens of each sequence, in row order.
        spans: tokens each occupies (real + padding); they add up to ``row_length``. A row with
            no sequence (a pack left empty) has one span of padding and a real length of 0.
        row_length: T.
    """

    lengths: tuple[int, ...]
    spans: tuple[int, ...]
    row_length: int

    def __post_init__(self) -> None:
        if len(self.lengths) != len(self.spans) or sum(self.spans) != self.row_length:
            raise ValueError(f"spans {self.spans} must add up to row_length {self.row_length} "
                             f"with one span per length {self.lengths}")
        if any(length > span for length, span in zip(self.lengths, self.spans, strict=True)):
            raise ValueError(f"a sequence is longer than its span: {self.lengths} vs {self.spans}")

    @classmethod
    def of(cls, pack: Pack) -> RowLayout:
        if not pack.indices:
            return cls(lengths=(0,), spans=(pack.row_length,), row_length=pack.row_length)
        return cls(lengths=pack.lengths, spans=pack.spans, row_length=pack.row_length)

    @property
    def starts(self) -> tuple[int, ...]:
        starts, offset = [], 0
        for span in self.spans:
            starts.append(offset)
            offset += span
        return tuple(starts)

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

    def gather_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index, valid)``, both ``[N, L]``: ``row[0, index]`` puts sequence i's token j at
        ``[i, j]``; ``valid`` is False past each sequence's length (where index is 0)."""
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
    past each sequence's end. Differentiable (a gather). ``index``: a precomputed
    :meth:`RowLayout.gather_index` on the row's device."""
    if row.shape[:2] != (1, layout.row_length):
        raise ValueError(f"a packed row is [1, {layout.row_length}, ...], got "
                         f"{tuple(row.shape)}")
    positions, valid = index if index is not None else layout.gather_index()
    positions, valid = positions.to(row.device), valid.to(row.device)
    gathered = row[0][positions]
    mask = valid.reshape(*valid.shape, *([1] * (gathered.dim() - 2)))
    return torch.where(mask, gathered, torch.as_tensor(fill, dtype=row.dtype, device=row.device))
