"""The part of a full (TP=1) tensor one engine rank keeps in its shadow: a :class:`TensorShard`.

Megatron's TP shard of a column-parallel weight is a set of row ranges (``linear_qkv``: one
contiguous range of whole query groups; ``linear_fc1``: ``[gate_t; up_t]``, two ranges), of a
row-parallel weight a column range, of a vocab-parallel embedding a row range; norms are
replicated. A vLLM rank of the same TP size holds the same row sets (its ``qkv_proj`` shard is
the same query groups, its ``gate_up_proj`` shard ``[gate_t; up_t]``), so one description serves
both engines. Shape suffixes: O = rows, I = input columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorShard:
    """Rows ``row_ranges`` (of the full tensor, stacked in this order) and columns
    ``[col_start, col_end)`` of a full tensor; for a 1-D tensor only the rows count."""

    row_ranges: tuple[tuple[int, int], ...]
    col_start: int = 0
    col_end: int | None = None
    """None: every column (and the only choice for a 1-D tensor)."""

    def columns(self, full_cols: int) -> tuple[int, int]:
        return self.col_start, full_cols if self.col_end is None else self.col_end

    def num_rows(self) -> int:
        return sum(hi - lo for lo, hi in self.row_ranges)

    def check(self, full_shape: tuple[int, ...], name: str) -> None:
        rows = full_shape[0]
        ok = all(0 <= lo < hi <= rows for lo, hi in self.row_ranges)
        if len(full_shape) == 1:
            ok = ok and (self.col_start, self.col_end) == (0, None)
        else:
            lo, hi = self.columns(full_shape[1])
            ok = ok and 0 <= lo < hi <= full_shape[1]
        if not ok or len(full_shape) > 2:
            raise RuntimeError(f"{name}: the engine's shard (rows {self.row_ranges}, columns "
                               f"[{self.col_start}, {self.col_end})) does not fit the full "
                               f"tensor {tuple(full_shape)}")

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This shard of ``full``: a new contiguous tensor."""
        rows = torch.cat([full[lo:hi] for lo, hi in self.row_ranges])
        if full.dim() == 1:
            return rows.contiguous()
        lo, hi = self.columns(full.shape[1])
        return rows[:, lo:hi].contiguous()

    def local_rows(self, full_rows: int) -> torch.Tensor:
        """For each full row, its row in the shard, or -1 where the shard does not hold it."""
        local = torch.full((full_rows,), -1, dtype=torch.long)
        start = 0
        for lo, hi in self.row_ranges:
            local[lo:hi] = torch.arange(start, start + hi - lo)
            start += hi - lo
        return local


def whole(full_shape: tuple[int, ...]) -> TensorShard:
    """The shard that is the full tensor."""
    return TensorShard(((0, full_shape[0]),))


def megatron_tp_shard(full_shape: tuple[int, ...], dim: int | None, stride: int, tp_rank: int,
                      tp_size: int) -> TensorShard:
    """TP rank ``tp_rank``'s shard as Megatron slices a tensor partitioned along ``dim`` with
    ``partition_stride`` ``stride`` (``megatron_logra.mcore.models.sharding.shard_from_full``):
    the full dimension cut into ``tp_size * stride`` equal chunks, the rank taking chunks
    ``tp_rank, tp_rank + tp_size, ...``."""
    if dim is None or tp_size == 1:
        return whole(full_shape)
    size = full_shape[dim]
    if size % (tp_size * stride):
        raise ValueError(f"dimension {dim} of size {size} does not split into {tp_size} shards "
                         f"with stride {stride}")
    chunk = size // (tp_size * stride)
    ranges = tuple((c * chunk, (c + 1) * chunk) for c in range(tp_rank, tp_size * stride, tp_size))
    if dim == 0:
        return TensorShard(ranges)
    if dim == 1 and len(ranges) == 1:
        return TensorShard(((0, full_shape[0]),), ranges[0][0], ranges[0][1])
    raise ValueError(f"a shard along dimension {dim} with stride {stride} is not a column range")
