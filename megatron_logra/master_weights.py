"""Exact masters of bf16 weights, sharded over data parallelism by whole rows: three stores.

A LoGRA step changes a weight by ~1e-4 of its size; bf16 resolves ~4e-3 relative, so merging the
update into bf16 weights directly rounds almost all of it away, silently, every step. The update
therefore goes into an exact fp32 master and the bf16 weight is re-derived from it.

Each data-parallel rank keeps masters only for the rows it owns (:class:`RowShard`): the step's
reduced sketch rows arrive by reduce-scatter, the rank updates its master rows, rounds them into
its rows of the bf16 weight and all-gathers the bf16 rows so that every replica holds the same
weight again -- Megatron's distributed optimizer, done by rows. Where the master rows live is
the choice of ``logra.master_weights`` (:func:`master_weights_mode`), made once:

* ``dp_sharded`` (:class:`RowShardedMaster`): fp32 rows on the device, 4/dp B per target param.
* ``remainder`` (:class:`RemainderMaster`): the bf16 weight already holds each master's high
  half; only the int16 low half is kept (:mod:`megatron_logra.bf16_remainder`), 2/dp B.
* ``host`` (:class:`HostMaster`): fp32 rows in (pinned) host memory, 0 B on the device; the
  merge streams them through the device in row chunks.

All three round with :func:`round_to_bf16` and compute the same fp32 update of the same rows, so
they give bit-identical weights on CPU (the host store's chunks are whole GEMM row blocks,
:mod:`megatron_logra.merge_chunks`); on a GPU ``remainder`` still computes dp_sharded's very GEMM,
while a host chunk's row count may make cuBLAS pick another kernel (tools/gpu_check.py
``master_merge`` measures it); a checkpoint holds the fp32 rows in every mode, so any mode
loads another's. Per target parameter that is 2 + {4, 2, 0}/dp device bytes, against 6 + 12/dp
for Megatron's distributed Adam.

Shape suffixes: O = owned rows, I = local input columns, R = sketch rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_logra.bf16_remainder import (
    combine_bf16_remainder,
    round_to_bf16,
    split_bf16_remainder,
)
from megatron_logra.merge_chunks import (
    MERGE_ROW_ALIGNMENT,
    MIB,
    host_chunk_rows,
    min_host_chunk_mib,
)
from megatron_logra.row_sharding import RowShard
from megatron_logra.sketch import apply_low_rank_update_


def _owned_rows(weight: torch.Tensor, shard: RowShard) -> Iterator[tuple[int, int, int]]:
    """``(block, first local row, last local row + 1)`` of every owned piece of ``weight``."""
    for block, (lo, hi) in enumerate(shard.ranges()):
        yield block, lo, hi


@torch.no_grad()
def gather_owned_rows_(
    weight: torch.Tensor, shard: RowShard, dp_group: dist.ProcessGroup | None
) -> int:
    """All-gather every rank's owned rows of ``weight`` (already written locally); returns the
    number of collectives.

    One all-gather per stride block: block ``b`` of the weight is ``[dp * c, n]`` contiguous
    rows, and DP rank ``d`` contributes its ``c`` rows of it (a copy: the input of an
    all-gather must not alias its output).
    """
    if shard.dp_size == 1:
        return 0
    blocks = weight.data.view(shard.stride, shard.block_rows, weight.shape[1])
    for block, lo, hi in _owned_rows(weight, shard):
        dist.all_gather_single(blocks[block], weight.data[lo:hi].clone(), group=dp_group)
    return shard.stride


def _owned_slices(shard: RowShard) -> Iterator[slice]:
    """The rows of each owned piece in the owned ``[O, I]`` tensors, block by block."""
    for block in range(shard.stride):
        yield slice(block * shard.chunk_rows, (block + 1) * shard.chunk_rows)


class RowMaster(Protocol):
    """The exact master rows this DP rank owns of one bf16 weight."""

    shard: RowShard

    def fp32_rows(self) -> torch.Tensor:
        """The owned rows as fp32 ``[O, I]`` (blocks in order), for checkpoints."""

    def fp32_row_blocks(self, max_rows: int) -> Iterator[torch.Tensor]:
        """The owned fp32 rows in order, at most ``max_rows`` at a time, each piece split at
        the same rows in every store (so a sum over them rounds alike in every mode); for
        norms, which need no copy of the whole."""

    def load_(self, master_OI: torch.Tensor) -> None:
        """Set the owned master rows (fp32) and this rank's rows of the weight from them."""

    def merge_(self, weight: torch.Tensor, direction_OR: torch.Tensor, proj_RI: torch.Tensor, *,
               lr: float, weight_decay: float, dp_group: dist.ProcessGroup | None) -> None:
        """``M <- (1 - lr wd) M - lr D A`` on the owned rows, then every replica's ``weight``
        rounded from the masters (collective over ``dp_group``)."""

    def device_tensors(self) -> list[torch.Tensor]:
        """What the master keeps on the weight's device between steps."""

    def host_tensors(self) -> list[torch.Tensor]:
        """What it keeps in host memory between steps (beside the device)."""


def _check_rows(weight: torch.Tensor, shard: RowShard) -> None:
    if weight.shape[0] != shard.rows:
        raise ValueError(f"weight has {weight.shape[0]} rows, the shard plan {shard.rows}")


def _load_checked(current: torch.Tensor, master_OI: torch.Tensor) -> None:
    if master_OI.shape != current.shape:
        raise RuntimeError(
            f"master shape {tuple(master_OI.shape)} does not match {tuple(current.shape)}"
        )


class RowShardedMaster:
    """``dp_sharded``: fp32 master rows on the weight's device."""

    def __init__(self, weight: torch.Tensor, shard: RowShard) -> None:
        _check_rows(weight, shard)
        self.shard = shard
        self.master_OI = torch.cat(
            [weight.detach()[lo:hi].float() for _, lo, hi in _owned_rows(weight, shard)], dim=0
        )

    @property
    def nbytes(self) -> int:
        return self.master_OI.numel() * self.master_OI.element_size()

    def fp32_rows(self) -> torch.Tensor:
        return self.master_OI

    def fp32_row_blocks(self, max_rows: int) -> Iterator[torch.Tensor]:
        for owned in _owned_slices(self.shard):
            yield from self.master_OI[owned].split(max_rows)

    def apply_update_(
        self, direction_OR: torch.Tensor, proj_RI: torch.Tensor, *, lr: float, weight_decay: float
    ) -> None:
        """``M <- (1 - lr wd) M - lr D A`` on the owned rows (D: this rank's owned rows)."""
        apply_low_rank_update_(
            self.master_OI, direction_OR, proj_RI, lr=lr, weight_decay=weight_decay
        )

    @torch.no_grad()
    def publish_(self, weight: torch.Tensor, dp_group: dist.ProcessGroup | None) -> int:
        """Write every rank's updated rows into ``weight`` on every rank; returns collectives."""
        chunk = self.shard.chunk_rows
        for block, lo, hi in _owned_rows(weight, self.shard):
            weight.data[lo:hi].copy_(round_to_bf16(self.master_OI[block * chunk:(block + 1) * chunk]))
        return gather_owned_rows_(weight, self.shard, dp_group)

    def merge_(self, weight: torch.Tensor, direction_OR: torch.Tensor, proj_RI: torch.Tensor, *,
               lr: float, weight_decay: float, dp_group: dist.ProcessGroup | None) -> None:
        self.apply_update_(direction_OR, proj_RI, lr=lr, weight_decay=weight_decay)
        self.publish_(weight, dp_group)

    def load_(self, master_OI: torch.Tensor) -> None:
        _load_checked(self.master_OI, master_OI)
        self.master_OI.copy_(master_OI)

    def device_tensors(self) -> list[torch.Tensor]:
        return [self.master_OI]

    def host_tensors(self) -> list[torch.Tensor]:
        return []


class RemainderMaster:
    """``remainder``: the bf16 weight's owned rows are the masters' high halves; the int16 low
    halves are kept here. The fp32 master exists only transiently, during a merge."""

    def __init__(self, weight: torch.Tensor, shard: RowShard) -> None:
        _check_rows(weight, shard)
        self.shard = shard
        self.weight = weight
        # A bf16 weight is its own master's rounding with remainder 0.
        self.remainder_OI = torch.zeros(
            shard.owned_rows, weight.shape[1], dtype=torch.int16, device=weight.device
        )

    def _pieces(self) -> Iterator[tuple[slice, slice]]:
        """``(rows of the weight, rows of the owned tensors)`` of every owned piece."""
        chunk = self.shard.chunk_rows
        for block, lo, hi in _owned_rows(self.weight, self.shard):
            yield slice(lo, hi), slice(block * chunk, (block + 1) * chunk)

    def fp32_rows(self) -> torch.Tensor:
        return torch.cat([
            combine_bf16_remainder(self.weight.detach()[rows], self.remainder_OI[owned])
            for rows, owned in self._pieces()
        ], dim=0)

    def fp32_row_blocks(self, max_rows: int) -> Iterator[torch.Tensor]:
        for rows, owned in self._pieces():
            weight_OI, remainder_OI = self.weight.detach()[rows], self.remainder_OI[owned]
            for start in range(0, weight_OI.shape[0], max_rows):
                yield combine_bf16_remainder(weight_OI[start:start + max_rows],
                                             remainder_OI[start:start + max_rows])

    @torch.no_grad()
    def load_(self, master_OI: torch.Tensor) -> None:
        _load_checked(self.remainder_OI, master_OI)
        for rows, owned in self._pieces():
            hi, remainder = split_bf16_remainder(master_OI[owned].float().contiguous())
            self.weight.data[rows].copy_(hi)
            self.remainder_OI[owned].copy_(remainder)

    @torch.no_grad()
    def merge_(self, weight: torch.Tensor, direction_OR: torch.Tensor, proj_RI: torch.Tensor, *,
               lr: float, weight_decay: float, dp_group: dist.ProcessGroup | None) -> None:
        if weight is not self.weight:
            raise RuntimeError("a remainder master merges into the weight it was built for")
        master_OI = self.fp32_rows()
        apply_low_rank_update_(master_OI, direction_OR, proj_RI, lr=lr, weight_decay=weight_decay)
        self.load_(master_OI)
        gather_owned_rows_(weight, self.shard, dp_group)

    def device_tensors(self) -> list[torch.Tensor]:
        return [self.remainder_OI]

    def host_tensors(self) -> list[torch.Tensor]:
        return []



class HostMaster:
    """``host``: fp32 master rows in host memory (pinned when the weight is on a GPU), merged
    through the device in chunks of ``chunk_rows`` owned rows.

    Per chunk: copy the master rows to a device staging buffer, add ``-lr D A``, round into the
    weight's rows, copy the rows back. On a GPU the copies run on their own stream with two
    staging buffers, so chunk ``k + 1`` travels while chunk ``k`` is computed; on CPU the
    staging buffer is ordinary memory and the chunks run one after another (the same arithmetic
    on the same rows, so the results equal the on-device masters').
    """

    def __init__(self, weight: torch.Tensor, shard: RowShard, *, chunk_rows: int) -> None:
        _check_rows(weight, shard)
        if chunk_rows <= 0 or chunk_rows % MERGE_ROW_ALIGNMENT:
            raise ValueError(
                f"chunk_rows={chunk_rows} must be a positive multiple of {MERGE_ROW_ALIGNMENT} "
                "rows (MERGE_ROW_ALIGNMENT), or the chunked merge rounds unlike the one-call one"
            )
        self.shard = shard
        self.chunk_rows = chunk_rows
        master = torch.cat(
            [weight.detach()[lo:hi].float().cpu() for _, lo, hi in _owned_rows(weight, shard)],
            dim=0,
        )
        self.master_OI = master.pin_memory() if weight.is_cuda else master
        self._copy_stream = torch.cuda.Stream(weight.device) if weight.is_cuda else None

    def fp32_rows(self) -> torch.Tensor:
        return self.master_OI

    def fp32_row_blocks(self, max_rows: int) -> Iterator[torch.Tensor]:
        for owned in _owned_slices(self.shard):
            yield from self.master_OI[owned].split(max_rows)

    def load_(self, master_OI: torch.Tensor) -> None:
        _load_checked(self.master_OI, master_OI)
        self.master_OI.copy_(master_OI)

    def _chunks(self, weight: torch.Tensor) -> list[tuple[slice, slice]]:
        """``(rows of the weight, rows of the master)`` per chunk; chunks stay inside a block."""
        chunks, chunk = [], self.shard.chunk_rows
        for block, lo, hi in _owned_rows(weight, self.shard):
            for start in range(0, hi - lo, self.chunk_rows):
                end = min(start + self.chunk_rows, hi - lo)
                owned = block * chunk
                chunks.append((slice(lo + start, lo + end), slice(owned + start, owned + end)))
        return chunks

    @torch.no_grad()
    def merge_(self, weight: torch.Tensor, direction_OR: torch.Tensor, proj_RI: torch.Tensor, *,
               lr: float, weight_decay: float, dp_group: dist.ProcessGroup | None) -> None:
        chunks = self._chunks(weight)
        width = weight.shape[1]
        staging = [torch.empty(min(self.chunk_rows, self.shard.chunk_rows), width,
                               dtype=torch.float32, device=weight.device)
                   for _ in range(2 if self._copy_stream is not None else 1)]
        if self._copy_stream is None:
            buffer = staging[0]
            for rows, owned in chunks:
                piece = buffer[: owned.stop - owned.start]
                piece.copy_(self.master_OI[owned])
                self._update_piece(weight, piece, rows, direction_OR[owned], proj_RI,
                                   lr=lr, weight_decay=weight_decay)
                self.master_OI[owned].copy_(piece)
        else:
            self._merge_overlapped(weight, chunks, staging, direction_OR, proj_RI,
                                   lr=lr, weight_decay=weight_decay)
        gather_owned_rows_(weight, self.shard, dp_group)

    @staticmethod
    def _update_piece(weight: torch.Tensor, piece_OI: torch.Tensor, rows: slice,
                      direction_OR: torch.Tensor, proj_RI: torch.Tensor, *, lr: float,
                      weight_decay: float) -> None:
        apply_low_rank_update_(piece_OI, direction_OR, proj_RI, lr=lr, weight_decay=weight_decay)
        weight.data[rows].copy_(round_to_bf16(piece_OI))

    def _merge_overlapped(self, weight: torch.Tensor, chunks: list[tuple[slice, slice]],
                          staging: list[torch.Tensor], direction_OR: torch.Tensor,
                          proj_RI: torch.Tensor, *, lr: float, weight_decay: float) -> None:
        """Chunk ``k + 1`` is copied in while chunk ``k`` is computed. The copy stream runs the
        loads and write-backs in order, so a staging buffer is reloaded only after its previous
        chunk was written back, and a write-back waits for its chunk's compute."""
        copy_stream, compute_stream = self._copy_stream, torch.cuda.current_stream(weight.device)
        loaded: list[torch.cuda.Event] = []

        def load(k: int) -> None:
            owned = chunks[k][1]
            piece = staging[k % 2][: owned.stop - owned.start]
            with torch.cuda.stream(copy_stream):
                piece.copy_(self.master_OI[owned], non_blocking=True)
                loaded.append(torch.cuda.Event())
                loaded[k].record(copy_stream)

        copy_stream.wait_stream(compute_stream)  # the staging buffers were allocated there
        load(0)
        for k, (rows, owned) in enumerate(chunks):
            if k + 1 < len(chunks):
                load(k + 1)
            piece = staging[k % 2][: owned.stop - owned.start]
            compute_stream.wait_event(loaded[k])
            self._update_piece(weight, piece, rows, direction_OR[owned], proj_RI,
                               lr=lr, weight_decay=weight_decay)
            computed = torch.cuda.Event()
            computed.record(compute_stream)
            copy_stream.wait_event(computed)
            with torch.cuda.stream(copy_stream):
                self.master_OI[owned].copy_(piece, non_blocking=True)
        # The host rows must be final before anyone reads them (a checkpoint, the next step),
        # and the staging buffers must outlive the copies that use them.
        copy_stream.synchronize()

    def device_tensors(self) -> list[torch.Tensor]:
        return []

    def host_tensors(self) -> list[torch.Tensor]:
        return [self.master_OI]


class _MasterMode:
    name: str
    shards_rows = True
    """Sketch rows reduce-scattered to their DP owner (False: all-reduced, every rank updates
    every row)."""

    def make(self, weight: torch.Tensor, shard: RowShard) -> RowMaster | None:
        raise NotImplementedError


class NoMasters(_MasterMode):
    """``none``: fp32 weights are their own masters; every DP rank updates every row."""

    name = "none"
    shards_rows = False

    def make(self, weight: torch.Tensor, shard: RowShard) -> RowMaster | None:
        return None


class DeviceMasters(_MasterMode):
    name = "dp_sharded"

    def make(self, weight: torch.Tensor, shard: RowShard) -> RowMaster | None:
        return RowShardedMaster(weight, shard)


class RemainderMasters(_MasterMode):
    name = "remainder"

    def make(self, weight: torch.Tensor, shard: RowShard) -> RowMaster | None:
        return RemainderMaster(weight, shard)


class HostMasters(_MasterMode):
    name = "host"

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes

    def make(self, weight: torch.Tensor, shard: RowShard) -> RowMaster | None:
        chunk_rows = host_chunk_rows(self.chunk_bytes, weight.shape[1])
        if chunk_rows == 0:  # the config refuses this (check_merge_chunk); never rounded up
            raise ValueError(
                f"logra.merge_chunk_mib={self.chunk_bytes / MIB:g} holds no group of "
                f"{MERGE_ROW_ALIGNMENT} fp32 rows of a target {weight.shape[1]} columns wide; "
                f"set it to at least {min_host_chunk_mib(weight.shape[1]):.4g}")
        return HostMaster(weight, shard, chunk_rows=chunk_rows)


def master_weights_mode(
    requested: str, weight_dtype: torch.dtype, *, merge_chunk_mib: float
) -> _MasterMode:
    """The store of ``logra.master_weights`` for weights of ``weight_dtype``: ``auto`` ->
    ``none`` for fp32 weights, ``dp_sharded`` for bf16; explicit choices checked."""
    if requested == "auto":
        requested = "none" if weight_dtype == torch.float32 else "dp_sharded"
    if requested == "none":
        if weight_dtype != torch.float32:
            raise ValueError(
                f"logra.master_weights=none merges updates into the weights themselves, which "
                f"are {weight_dtype}: a ~1e-4 relative update is below bf16 resolution and "
                "would be lost; use logra.master_weights=dp_sharded, remainder or host (or "
                "model.params_dtype=fp32)"
            )
        return NoMasters()
    if weight_dtype != torch.bfloat16:
        raise ValueError(
            f"logra.master_weights={requested} keeps exact masters of bf16 weights; the weights "
            f"are {weight_dtype}, their own masters: use logra.master_weights=none (or auto)"
        )
    if requested == "dp_sharded":
        return DeviceMasters()
    if requested == "remainder":
        return RemainderMasters()
    if requested == "host":
        return HostMasters(int(merge_chunk_mib * MIB))
    raise ValueError(f"unknown logra.master_weights={requested!r}")


MASTER_MODE_NAMES: tuple[str, ...] = tuple(
    mode.name for mode in (NoMasters, DeviceMasters, RemainderMasters, HostMasters)
)
"""The stores' names; config.MASTER_WEIGHTS offers these and ``auto`` (a layering test)."""
