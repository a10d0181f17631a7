"""One flat fp32 buffer that holds every sketch of a model (chunk), and its reduction.

All per-layer sketches are views of one contiguous buffer, so zeroing, scaling, clipping and the
data-parallel reduction are single operations per step instead of one per layer.

Tensor parallelism decides what a rank's sketch of a layer is:

* a column-parallel shard owns output rows; its sketch rows are complete on the rank
  (``tp_partial=False``);
* a row-parallel shard owns input columns; it computes ``H^T (X_local A_local^T)``, a partial sum
  over the tensor-parallel group of the full ``[m, r]`` sketch (``tp_partial=True``).

Complete sketches come first in the buffer and partial ones last, so that each kind is one
contiguous segment: the complete segment is all-reduced over the data-parallel group, the partial
segment over the tensor-and-data-parallel group (the TP sum and the DP sum in one collective).
With TP = 1 that is a single collective over the data-parallel group.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SketchSlot:
    """Where one target layer's sketch lives.

    Attributes:
        layer_key: stable name of the layer (global layer number, no wrapper prefixes).
        rows: output rows held on this rank (m / tp for column-parallel, m for row-parallel).
        sketch_rank: columns of the sketch (r; the input width n for the identity projection).
        tp_partial: True when the rank's sketch is a partial sum over the tensor-parallel group.
    """

    layer_key: str
    rows: int
    sketch_rank: int
    tp_partial: bool

    @property
    def numel(self) -> int:
        return self.rows * self.sketch_rank


class FlatSketchBuffer:
    """A flat fp32 buffer with one ``[rows, sketch_rank]`` view per :class:`SketchSlot`."""

    def __init__(
        self,
        slots: Sequence[SketchSlot],
        *,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        keys = [slot.layer_key for slot in slots]
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate layer keys among sketch slots: {keys}")
        complete = [slot for slot in slots if not slot.tp_partial]
        partial = [slot for slot in slots if slot.tp_partial]
        self.slots: tuple[SketchSlot, ...] = tuple(complete + partial)
        self.partial_start = sum(slot.numel for slot in complete)
        total = self.partial_start + sum(slot.numel for slot in partial)
        # fp32 in training; float64 only for reference computations in tests.
        self.data = torch.zeros(total, dtype=dtype, device=device)
        self._views: dict[str, torch.Tensor] = {}
        offset = 0
        for slot in self.slots:
            view = self.data[offset : offset + slot.numel].view(slot.rows, slot.sketch_rank)
            self._views[slot.layer_key] = view
            offset += slot.numel

    def view(self, layer_key: str) -> torch.Tensor:
        """The ``[rows, sketch_rank]`` view of one layer's sketch."""
        return self._views[layer_key]

    def items(self) -> Iterator[tuple[SketchSlot, torch.Tensor]]:
        for slot in self.slots:
            yield slot, self._views[slot.layer_key]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def zero_(self) -> None:
        self.data.zero_()

    def all_reduce_(
        self,
        *,
        dp_group: dist.ProcessGroup | None,
        tp_dp_group: dist.ProcessGroup | None,
        tp_size: int,
    ) -> int:
        """Sum the sketches over data parallelism, and the partial ones over TP as well.

        Returns the number of collectives issued (0, 1 or 2), so callers and tests can see that
        the reduction is one operation per segment, not one per layer.
        """
        collectives = 0
        partial = self.data[self.partial_start :]
        if tp_size > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"tp_size={tp_size} but torch.distributed is not initialised: row-parallel "
                "partial sketches cannot be summed"
            )
        if tp_size > 1 and partial.numel() > 0:
            complete = self.data[: self.partial_start]
            if complete.numel() > 0 and _group_size(dp_group) > 1:
                dist.all_reduce(complete, group=dp_group)
                collectives += 1
            dist.all_reduce(partial, group=tp_dp_group)
            collectives += 1
        elif _group_size(dp_group) > 1:
            dist.all_reduce(self.data, group=dp_group)
            collectives += 1
        return collectives


def _group_size(group: dist.ProcessGroup | None) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)
