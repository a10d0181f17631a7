"""One flat fp32 buffer that holds every sketch of a model (chunk set), and its reduction.

All per-layer sketches live in one contiguous buffer, so zeroing, scaling, clipping and the
data-parallel reduction are a handful of operations per step instead of one per layer.

Tensor parallelism decides what a rank's sketch of a layer is:

* a column-parallel shard owns output rows; its sketch rows are complete on the rank
  (``tp_partial=False``);
* a row-parallel shard owns input columns; it computes ``H^T (X_local A_local^T)``, a partial sum
  over the tensor-parallel group of the full ``[m, r]`` sketch (``tp_partial=True``).

Complete sketches form the first region of the buffer and partial ones the second, so each kind
is reduced by one collective over its region. Routed experts of an MoE model (``expert=True``)
have two regions of their own after those: an expert's copies live on the expert-data-parallel
group (the DP ranks that hold the same experts), so its sketch is reduced over that group, never
over the dense DP group (whose other members hold other experts at the same offsets) -- and when
sharded, it is sharded over that group (``expert_dp_size``), not over DP. The buffer also counts
the token rows each slot accumulated, so that an expert that received no tokens in a step can be
told apart (:meth:`FlatSketchBuffer.received_tokens`).

Two layouts:

* **replicated** (``dp_size=1`` in the layout, the fp32-parameter mode): each region is the layers
  one after another; the complete region is all-reduced over DP, the partial region over TP x DP
  in one collective. Every DP rank ends with every reduced row.
* **DP-sharded** (``dp_size>1``, bf16 parameters with sharded fp32 masters): each region is
  ``[dp][layers' owned pieces]`` so that DP rank ``d``'s rows of *all* layers form one contiguous
  segment. The partial region is first all-reduced over TP; each region is then reduce-scattered
  over DP, leaving every rank the reduced rows it owns (see :mod:`megatron_logra.row_sharding`).
  During backward a layer accumulates into several pieces, one per (DP owner, stride block).
  The expert regions are ``[expert_dp][experts' owned pieces]`` the same way, reduce-scattered
  over the expert-data-parallel group (an expert-DP size of 1 leaves each rank all the rows of
  its experts).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_logra.row_sharding import RowShard
from megatron_logra.sketch import accumulate_sketch_


@dataclass(frozen=True)
class SketchSlot:
    """Where one target layer's sketch lives.

    Attributes:
        layer_key: stable name of the layer (global layer number, no wrapper prefixes).
        rows: output rows held on this rank (m / tp for column-parallel, m for row-parallel).
        sketch_rank: columns of the sketch (r; the input width n for the identity projection).
        tp_partial: True when the rank's sketch is a partial sum over the tensor-parallel group.
        stride: interleaved row blocks of the TP shard (2 for a gated fc1), for DP sharding.
        expert: a routed expert's sketch, reduced (and, when sharded, sharded) over the
            expert-data-parallel group.
    """

    layer_key: str
    rows: int
    sketch_rank: int
    tp_partial: bool
    stride: int = 1
    expert: bool = False

    @property
    def numel(self) -> int:
        return self.rows * self.sketch_rank


@dataclass(frozen=True)
class RowPiece:
    """Local rows ``row_start:row_end`` of a layer's sketch, stored at ``view`` (which starts at
    element ``offset`` of the flat buffer)."""

    row_start: int
    row_end: int
    offset: int
    view: torch.Tensor


@dataclass
class _Region:
    start: int
    numel: int
    segment: int
    """Elements per owner (the whole region when replicated)."""
    owners: int = 1
    """Ranks the region is sharded over (DP, or expert-DP for the expert regions)."""
    rank: int = 0
    """This rank's owner index among them."""

    def mine(self, data: torch.Tensor) -> torch.Tensor:
        """This rank's owned segment of the region."""
        start = self.start + self.rank * self.segment
        return data[start : start + self.segment]


class FlatSketchBuffer:
    """A flat buffer with row pieces per :class:`SketchSlot`, replicated or DP-sharded."""

    def __init__(
        self,
        slots: Sequence[SketchSlot],
        *,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        dp_size: int = 1,
        dp_rank: int = 0,
        expert_dp_size: int = 1,
        expert_dp_rank: int = 0,
    ) -> None:
        keys = [slot.layer_key for slot in slots]
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate layer keys among sketch slots: {keys}")
        self.dp_size, self.dp_rank = dp_size, dp_rank
        if expert_dp_size > 1 and dp_size == 1:
            raise ValueError(
                f"expert_dp_size={expert_dp_size} with dp_size=1: the expert-data-parallel "
                "group is part of the data-parallel one; shard both or neither"
            )
        complete = [slot for slot in slots if not slot.tp_partial and not slot.expert]
        partial = [slot for slot in slots if slot.tp_partial and not slot.expert]
        expert_complete = [slot for slot in slots if not slot.tp_partial and slot.expert]
        expert_partial = [slot for slot in slots if slot.tp_partial and slot.expert]
        self.slots: tuple[SketchSlot, ...] = tuple(
            complete + partial + expert_complete + expert_partial
        )
        owners = {False: (dp_size, dp_rank), True: (expert_dp_size, expert_dp_rank)}
        self.shards = {
            slot.layer_key: RowShard(slot.rows, slot.stride, *owners[slot.expert])
            for slot in self.slots
        }
        regions: list[_Region] = []
        start = 0
        for group, expert in ((complete, False), (partial, False), (expert_complete, True),
                              (expert_partial, True)):
            ways, rank = owners[expert]
            segment = sum(self.shards[s.layer_key].owned_rows * s.sketch_rank for s in group)
            regions.append(_Region(start=start, numel=segment * ways, segment=segment,
                                   owners=ways, rank=rank))
            start += segment * ways
        self._complete, self._partial, self._expert_complete, self._expert_partial = regions
        self.partial_start = self._partial.start
        # fp32 in training; float64 only for reference computations in tests.
        self.data = torch.zeros(start, dtype=dtype, device=device)
        self._pieces: dict[str, tuple[RowPiece, ...]] = {}
        self._owned: dict[str, torch.Tensor] = {}
        for group, region in ((complete, self._complete), (partial, self._partial),
                              (expert_complete, self._expert_complete),
                              (expert_partial, self._expert_partial)):
            offset = 0
            for slot in group:
                self._place(slot, region, offset)
                offset += self.shards[slot.layer_key].owned_rows * slot.sketch_rank
        self._slot_index = {slot.layer_key: i for i, slot in enumerate(self.slots)}
        # Token rows accumulated per slot this step (float64: exact for any realistic count).
        self.token_rows = torch.zeros(len(self.slots), dtype=torch.float64, device=device)

    def _place(self, slot: SketchSlot, region: _Region, offset: int) -> None:
        shard, r = self.shards[slot.layer_key], slot.sketch_rank
        if region.owners == 1:
            # Replicated: the layer's rows are one contiguous [rows, r] block.
            at = region.start + offset
            view = self.data[at : at + slot.rows * r].view(slot.rows, r)
            self._pieces[slot.layer_key] = (RowPiece(0, slot.rows, at, view),)
            self._owned[slot.layer_key] = view
            return
        pieces: list[RowPiece] = []
        for d in range(region.owners):
            base = region.start + d * region.segment + offset
            for block, (lo, hi) in enumerate(shard.ranges(d)):
                at = base + block * shard.chunk_rows * r
                pieces.append(
                    RowPiece(lo, hi, at, self.data[at : at + (hi - lo) * r].view(-1, r))
                )
        self._pieces[slot.layer_key] = tuple(sorted(pieces, key=lambda piece: piece.row_start))
        mine = region.start + region.rank * region.segment + offset
        self._owned[slot.layer_key] = self.data[mine : mine + shard.owned_rows * r].view(-1, r)

    # ------------------------------------------------------------------ access

    @property
    def sharded(self) -> bool:
        return self.dp_size > 1

    def pieces(self, layer_key: str, data: torch.Tensor | None = None) -> tuple[RowPiece, ...]:
        """Where backward accumulates: all local rows of the layer, in row order. With ``data``
        (a tensor laid out like the buffer, e.g. :meth:`gathered_data`) the views are into it."""
        pieces = self._pieces[layer_key]
        if data is None:
            return pieces
        return tuple(
            RowPiece(p.row_start, p.row_end, p.offset,
                     data[p.offset : p.offset + p.view.numel()].view_as(p.view))
            for p in pieces
        )

    def gathered_data(self, *, dp_group: dist.ProcessGroup | None,
                      expert_dp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Every owner's reduced rows, laid out like the buffer (collective when sharded).

        Replicated layouts already hold every row: the buffer itself is returned. Sharded ones
        all-gather each sharded region's owned segments into a new tensor, one collective per
        region (the expert regions over ``expert_dp_group``).
        """
        if not self.sharded:
            return self.data
        full = torch.empty_like(self.data)
        for region, group in ((self._complete, dp_group), (self._partial, dp_group),
                              (self._expert_complete, expert_dp_group),
                              (self._expert_partial, expert_dp_group)):
            if not region.numel:
                continue
            out = _region_view(full, region)
            if region.owners == 1:
                out.copy_(_region_view(self.data, region))
            else:
                dist.all_gather_single(out, region.mine(self.data).contiguous(), group=group)
        return full

    def view(self, layer_key: str) -> torch.Tensor:
        """The full ``[rows, sketch_rank]`` view (replicated layout only)."""
        pieces = self._pieces[layer_key]
        if len(pieces) != 1:
            raise RuntimeError(
                f"{layer_key}: the sketch is split over data-parallel owners; use owned_view"
            )
        return pieces[0].view

    def owned_view(self, layer_key: str) -> torch.Tensor:
        """The rows this DP rank owns after reduction, ``[owned_rows, sketch_rank]``, in the
        order of ``shards[layer_key].ranges()`` (all rows when replicated)."""
        return self._owned[layer_key]

    def owned_items(self) -> Iterator[tuple[SketchSlot, torch.Tensor]]:
        for slot in self.slots:
            yield slot, self._owned[slot.layer_key]

    def owned_segments(self) -> tuple[torch.Tensor, ...]:
        """The flat parts of the buffer holding this rank's reduced rows (one per region)."""
        return tuple(region.mine(self.data) for region in self._regions() if region.numel)

    def _regions(self) -> tuple[_Region, ...]:
        return (self._complete, self._partial, self._expert_complete, self._expert_partial)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def zero_(self) -> None:
        self.data.zero_()
        self.token_rows.zero_()

    def received_tokens(self, layer_key: str) -> float:
        """Token rows the layer's sketch accumulated this step; for an expert slot, after
        :meth:`reduce_`, summed over its expert-data-parallel group (so every rank holding
        the expert agrees whether it received any token)."""
        return float(self.token_rows[self._slot_index[layer_key]].item())

    def accumulate_(
        self, layer_key: str, grad_output_TO: torch.Tensor, projected_TR: torch.Tensor
    ) -> None:
        """``S += H^T P`` for one layer, into every piece of its rows, in the buffer's dtype."""
        self.token_rows[self._slot_index[layer_key]] += grad_output_TO.shape[0]
        for piece in self._pieces[layer_key]:
            accumulate_sketch_(
                piece.view, grad_output_TO[:, piece.row_start : piece.row_end], projected_TR
            )

    # ------------------------------------------------------------------ reduction

    def reduce_(
        self,
        *,
        dp_group: dist.ProcessGroup | None,
        tp_group: dist.ProcessGroup | None,
        tp_dp_group: dist.ProcessGroup | None,
        tp_size: int,
        expert_dp_group: dist.ProcessGroup | None = None,
    ) -> int:
        """Sum the step's sketches over data parallelism (partials over TP as well).

        Replicated layout: every rank ends with every reduced row. Sharded layout: every rank
        ends with the reduced rows it owns (``owned_segments``). Returns the number of
        collectives issued, so callers and tests can see it is one per region (plus the TP sum
        of the partial region when sharded), never one per layer.
        """
        initialised = dist.is_available() and dist.is_initialized()
        if (tp_size > 1 or self.sharded) and not initialised:
            raise RuntimeError(
                f"tp_size={tp_size}, dp shards={self.dp_size} but torch.distributed is not "
                "initialised: sketches cannot be reduced"
            )
        collectives = self._reduce_experts(expert_dp_group, tp_group, tp_size)
        complete = self.data[self._complete.start : self._complete.start + self._complete.numel]
        partial = self.data[self._partial.start : self._partial.start + self._partial.numel]
        if not self.sharded:
            if tp_size > 1 and partial.numel() > 0:
                if complete.numel() > 0 and _group_size(dp_group) > 1:
                    dist.all_reduce(complete, group=dp_group)
                    collectives += 1
                dist.all_reduce(partial, group=tp_dp_group)
                collectives += 1
            elif _group_size(dp_group) > 1 and self._expert_complete.start > 0:
                dist.all_reduce(self.data[: self._expert_complete.start], group=dp_group)
                collectives += 1
            return collectives
        if tp_size > 1 and partial.numel() > 0:
            dist.all_reduce(partial, group=tp_group)
            collectives += 1
        for region in (self._complete, self._partial):
            collectives += self._reduce_scatter(region, dp_group)
        return collectives

    def _reduce_scatter(self, region: _Region, group: dist.ProcessGroup | None) -> int:
        """Sum a sharded region over its owners, leaving this rank its reduced segment."""
        if region.numel == 0:
            return 0
        mine = region.mine(self.data)
        # reduce_scatter writes this rank's reduced segment; the input must not alias it.
        reduced = torch.empty_like(mine)
        dist.reduce_scatter_single(reduced, _region_view(self.data, region), group=group)
        mine.copy_(reduced)
        return 1

    def _reduce_experts(
        self, expert_dp_group: dist.ProcessGroup | None, tp_group: dist.ProcessGroup | None,
        tp_size: int,
    ) -> int:
        """Expert regions: row-parallel partials summed over (expert) TP, then both regions and
        the experts' token counts over the expert-data-parallel group (reduce-scattered when
        sharded over it)."""
        expert_complete = _region_view(self.data, self._expert_complete)
        expert_partial = _region_view(self.data, self._expert_partial)
        if expert_complete.numel() + expert_partial.numel() == 0:
            return 0
        if expert_dp_group is None and _group_size(None) > 1:
            raise RuntimeError(
                "expert sketches need their expert-data-parallel group to be reduced (the "
                "default group would sum different experts); pass expert_dp_group"
            )
        collectives = 0
        if tp_size > 1 and expert_partial.numel() > 0:
            dist.all_reduce(expert_partial, group=tp_group)
            collectives += 1
        if _group_size(expert_dp_group) > 1:
            if self._expert_complete.owners > 1:
                for region in (self._expert_complete, self._expert_partial):
                    collectives += self._reduce_scatter(region, expert_dp_group)
            else:
                experts = self.data[self._expert_complete.start :]
                dist.all_reduce(experts, group=expert_dp_group)
                collectives += 1
            dist.all_reduce(self.token_rows, group=expert_dp_group)
            collectives += 1
        return collectives


def _region_view(data: torch.Tensor, region: _Region) -> torch.Tensor:
    return data[region.start : region.start + region.numel]


def _group_size(group: dist.ProcessGroup | None) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)
