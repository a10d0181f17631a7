"""Which output rows of a layer each data-parallel rank owns when masters are sharded.

With bf16 parameters LoGRA keeps fp32 masters and row moments only for a 1/dp share of every
target layer's rows (ZeRO-1 style, but by whole rows: RowAdam normalises a row with its own
second moment, and the update of a row needs the whole sketch row).

A tensor-parallel shard can interleave blocks: Megatron's gated fc1 stores ``[gate_t; up_t]``
on TP rank t (``partition_stride = 2``). Rows are therefore split per stride block: block ``b`` of
``B = rows / stride`` rows is cut into ``dp`` chunks of ``c = B / dp`` rows, and DP rank ``d`` owns
chunk ``d`` of every block. Each owned piece then maps to one contiguous range of the full
(TP=1) weight's rows -- the property that makes the masters checkpointable with uniform shards.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowShard:
    """Row ownership of one layer's local rows for one data-parallel rank.

    Attributes:
        rows: local output rows of the layer on this TP rank.
        stride: interleaved blocks in those rows (Megatron's ``partition_stride``).
        dp_size, dp_rank: the data-parallel group this layout shards over.
    """

    rows: int
    stride: int
    dp_size: int
    dp_rank: int

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.stride <= 0 or self.dp_size <= 0:
            raise ValueError(f"invalid row shard {self}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} outside [0, {self.dp_size})")
        if self.rows % self.stride or (self.rows // self.stride) % self.dp_size:
            raise ValueError(
                f"a layer with {self.rows} local rows in {self.stride} block(s) cannot be split "
                f"evenly over dp={self.dp_size} ranks; sharded masters need every target's "
                "local rows per block to be divisible by the data-parallel size (choose dp "
                "accordingly, or use fp32 parameters)"
            )

    @property
    def block_rows(self) -> int:
        return self.rows // self.stride

    @property
    def chunk_rows(self) -> int:
        """Rows per (block, DP rank) piece."""
        return self.block_rows // self.dp_size

    @property
    def owned_rows(self) -> int:
        return self.stride * self.chunk_rows

    def ranges(self, dp_rank: int | None = None) -> tuple[tuple[int, int], ...]:
        """Local row ranges owned by ``dp_rank`` (default: this rank), block by block."""
        d = self.dp_rank if dp_rank is None else dp_rank
        c, b_rows = self.chunk_rows, self.block_rows
        return tuple((b * b_rows + d * c, b * b_rows + (d + 1) * c) for b in range(self.stride))
