"""The rollout engine's exact shadow of the policy, kept in step by sync records.

Per-step LoGRA updates are ~1e-4 of a weight, below bf16 resolution, so an engine that merged
them into bf16 weights would lose them (measured on a 1024² weight at r = 16 and 1e-4 relative
updates: 44% of the entries differ from the trainer's bf16 weight after 325 steps). The shadow keeps an fp32 copy of every target weight -- the trainer's master, bit for
bit -- replays each update with the trainer's own merge function
(:func:`megatron_logra.sketch.apply_low_rank_update_`) on blocks of the trainer's shapes, and
casts the served weights from it, so the served weights equal the trainer's.

Rules: a full sync (:class:`FullSyncBucket` s) comes first and resets every count; a target's
low-rank updates must arrive as 1, 2, 3, ... after it (a gap or a repeat raises, naming the
layer, the expected and the received count); dense values must be newer than the last one of
that parameter. A refused record changes nothing.

Shape suffixes: O = rows, I = input columns, R = sketch rank.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron_logra.bf16_remainder import round_to_bf16
from megatron_logra.projection import generate_projection, projection_key
from megatron_logra.sketch import apply_low_rank_update_
from megatron_logra.sync.checksum import weight_checksums
from megatron_logra.sync.records import (
    PROJECTION_DTYPES,
    DenseUpdate,
    FactorPiece,
    FullSyncBucket,
    LowRankUpdate,
    SyncRecord,
)


def regenerate_projection(update: LowRankUpdate, col_start: int, col_end: int) -> torch.Tensor:
    """Columns ``col_start:col_end`` of the update's A, rounded as the trainer rounded it."""
    key = projection_key(update.seed, update.projection_count, update.layer_key)
    proj_RI = generate_projection(key, update.sketch_rank, col_start, col_end,
                                  update.distribution, dtype=torch.float32)
    rounding = PROJECTION_DTYPES[update.projection_dtype]
    return proj_RI if rounding == torch.float32 else proj_RI.to(rounding).float()


def _merge_piece_(master_OI: torch.Tensor, piece: FactorPiece, proj_RI: torch.Tensor,
                  *, lr: float, weight_decay: float) -> None:
    """One trainer merge call, replayed on a block of the same shape (so: the same rounding)."""
    rows, cols = master_OI.shape
    factor_OR = piece.factor_OR.float()
    if piece.row_ranges == ((0, rows),) and (piece.col_start, piece.col_end) == (0, cols):
        apply_low_rank_update_(master_OI, factor_OR, proj_RI, lr=lr, weight_decay=weight_decay)
        return
    block_OI = torch.cat(
        [master_OI[lo:hi, piece.col_start : piece.col_end] for lo, hi in piece.row_ranges]
    ).contiguous()
    apply_low_rank_update_(block_OI, factor_OR, proj_RI, lr=lr, weight_decay=weight_decay)
    start = 0
    for lo, hi in piece.row_ranges:
        master_OI[lo:hi, piece.col_start : piece.col_end] = block_OI[start : start + hi - lo]
        start += hi - lo


class EngineShadow:
    """fp32 shadows of the target weights and the served weights cast from them.

    Args:
        target_names: parameter names of the LoGRA targets (``<layer_key>.weight``).
        served_dtype: the dtype the engine computes with (the trainer's parameter dtype).
    """

    def __init__(self, target_names: Iterable[str], *, served_dtype: torch.dtype) -> None:
        self.target_names = frozenset(target_names)
        self.served_dtype = served_dtype
        self.masters: dict[str, torch.Tensor] = {}
        self.served: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self._pending: list[FullSyncBucket] = []

    # ------------------------------------------------------------------ records

    def apply(self, record: SyncRecord) -> None:
        if isinstance(record, LowRankUpdate):
            self.apply_low_rank(record)
        elif isinstance(record, DenseUpdate):
            self.apply_dense(record)
        elif isinstance(record, FullSyncBucket):
            self.apply_full_bucket(record)
        else:
            raise TypeError(f"not a sync record: {type(record).__name__}")

    def apply_full_bucket(self, bucket: FullSyncBucket) -> None:
        """Collect the buckets of one full sync; the last one replaces all state at once."""
        first = self._pending[0] if self._pending else bucket
        if bucket.index != len(self._pending) or (bucket.update_count, bucket.num_buckets) != (
            first.update_count, first.num_buckets
        ):
            received = len(self._pending)
            self._pending = []
            raise RuntimeError(
                f"full sync bucket {bucket.index} of {bucket.num_buckets} (update "
                f"{bucket.update_count}) out of order after {received} bucket(s) of update "
                f"{first.update_count}; the partial full sync was dropped: restart it from "
                "bucket 0"
            )
        self._pending.append(bucket)
        if len(self._pending) < bucket.num_buckets:
            return
        tensors = {n: t for b in self._pending for n, t in b.tensors.items()}
        self._pending = []
        missing = sorted(self.target_names - tensors.keys())
        if missing:
            raise RuntimeError(f"full sync lacks target weights {missing[:4]}")
        masters, served = {}, {}
        for name, tensor in tensors.items():
            if name in self.target_names:
                if tensor.dtype != torch.float32:
                    raise RuntimeError(
                        f"full sync sent {name} as {tensor.dtype}; targets travel as their fp32 "
                        "master (the shadow must start from the exact state)"
                    )
                masters[name] = tensor.clone()
                served[name] = self._cast(masters[name])
            else:
                served[name] = tensor.to(self.served_dtype).clone()
        self.masters, self.served = masters, served
        self.counts = dict.fromkeys(tensors, bucket.update_count)

    def apply_low_rank(self, update: LowRankUpdate) -> None:
        name = update.param_name
        if name not in self.masters:
            raise RuntimeError(
                f"low-rank update {update.update_count} of {update.layer_key}: the engine has no "
                "shadow of it (no full sync yet, or not a target)"
            )
        expected = self.counts[name] + 1
        if update.update_count != expected:
            raise RuntimeError(
                f"refusing update of {update.layer_key}: expected update_count {expected}, got "
                f"{update.update_count} ({'repeated' if update.update_count < expected else 'a gap'}"
                "); request a full sync"
            )
        master_OI = self.masters[name]
        if master_OI.shape[1] != update.in_features:
            raise RuntimeError(f"{update.layer_key}: shadow has {master_OI.shape[1]} input "
                               f"columns, the update {update.in_features}")
        for piece in update.pieces:  # check all before changing anything
            self._check_piece(update, piece, master_OI.shape)
        for piece in update.pieces:
            proj_RI = regenerate_projection(update, piece.col_start, piece.col_end)
            _merge_piece_(master_OI, piece, proj_RI, lr=update.lr,
                          weight_decay=update.weight_decay)
        self.served[name] = self._cast(master_OI)
        self.counts[name] = expected

    @staticmethod
    def _check_piece(update: LowRankUpdate, piece: FactorPiece, shape: torch.Size) -> None:
        rows, cols = shape
        inside = all(0 <= lo < hi <= rows for lo, hi in piece.row_ranges)
        if not inside or not 0 <= piece.col_start < piece.col_end <= cols:
            raise RuntimeError(
                f"{update.layer_key}: piece rows {piece.row_ranges}, columns "
                f"[{piece.col_start}, {piece.col_end}) outside the shadow's {tuple(shape)}"
            )
        if piece.factor_OR.shape[1] != update.sketch_rank:
            raise RuntimeError(f"{update.layer_key}: factor has {piece.factor_OR.shape[1]} "
                               f"columns, sketch_rank is {update.sketch_rank}")

    def apply_dense(self, update: DenseUpdate) -> None:
        if update.name in self.target_names:
            raise RuntimeError(f"{update.name} is a target: it syncs by low-rank updates")
        if update.name not in self.served:
            raise RuntimeError(f"dense update of unknown parameter {update.name}")
        last = self.counts[update.name]
        if update.update_count <= last:
            raise RuntimeError(
                f"refusing dense update of {update.name}: got update_count "
                f"{update.update_count}, it already holds update {last}"
            )
        served = self.served[update.name]
        if update.value.shape != served.shape:
            raise RuntimeError(f"dense update of {update.name} has shape "
                               f"{tuple(update.value.shape)}, the engine {tuple(served.shape)}")
        served.copy_(update.value)
        self.counts[update.name] = update.update_count

    # ------------------------------------------------------------------ served state

    def _cast(self, master_OI: torch.Tensor) -> torch.Tensor:
        if self.served_dtype == torch.float32:
            return master_OI  # served directly: no second copy
        if self.served_dtype == torch.bfloat16:
            # The trainer's masters round with this function (ties away from zero, which torch's
            # cast does not); a cast would differ from the trainer's weight at every exact tie.
            return round_to_bf16(master_OI)
        return master_OI.to(self.served_dtype)

    def checksums(self) -> dict[str, str]:
        """Digests of the served weights (:func:`megatron_logra.sync.checksum.weight_checksum`)."""
        return weight_checksums(self.served.items())
