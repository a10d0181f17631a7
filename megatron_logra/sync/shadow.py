"""The rollout engine's exact shadow of the policy, kept in step by sync records.

Per-step LoGRA updates are ~1e-4 of a weight, below bf16 resolution, so an engine that merged
them into bf16 weights would lose them (measured on a 1024² weight at r = 16 and 1e-4 relative
updates: 44% of the entries differ from the trainer's bf16 weight after 325 steps). The shadow
keeps an fp32 copy of every target weight -- the trainer's master, bit for bit -- replays each
update with the trainer's own merge function (:func:`megatron_logra.sketch.apply_low_rank_update_`)
on blocks of the trainer's shapes, and casts the served weights from it, so the served weights
equal the trainer's. An engine rank may keep only its TP shard of each tensor
(:class:`~megatron_logra.sync.shard.TensorShard`): 1/TP of the bytes, the same bits.

Rules: a full sync (:class:`FullSyncBucket` s) comes first and resets every count; a target's
low-rank updates must arrive as 1, 2, 3, ... after it (a gap or a repeat raises, naming the
layer, the expected and the received count); dense values must be newer than the last one of
that parameter; a delta (:mod:`megatron_logra.sync.delta`) must be against the update the
engine holds. A refused record changes nothing.

Under ``sync.mode=delta`` the shadow has no targets: it holds the served weights only and XORs
each delta into them (no fp32 master on the engine).

Shape suffixes: O = rows, I = input columns, R = sketch rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from megatron_logra.bf16_remainder import round_to_bf16
from megatron_logra.projection import generate_projection, projection_key
from megatron_logra.sketch import apply_low_rank_update_
from megatron_logra.sync.checksum import weight_checksums
from megatron_logra.sync.delta import DeltaBucket, apply_xor_, decoded_xor
from megatron_logra.sync.records import (
    PROJECTION_DTYPES,
    DenseUpdate,
    FactorPiece,
    FullSyncBucket,
    LowRankUpdate,
    SyncRecord,
)
from megatron_logra.sync.shard import TensorShard, whole

HOST = torch.device("cpu")


def regenerate_projection(update: LowRankUpdate, col_start: int, col_end: int) -> torch.Tensor:
    """Columns ``col_start:col_end`` of the update's A, rounded as the trainer rounded it."""
    key = projection_key(update.seed, update.projection_count, update.layer_key)
    proj_RI = generate_projection(key, update.sketch_rank, col_start, col_end,
                                  update.distribution, dtype=torch.float32)
    rounding = PROJECTION_DTYPES[update.projection_dtype]
    return proj_RI if rounding == torch.float32 else proj_RI.to(rounding).float()


def _merge_on_(block_OI: torch.Tensor, factor_OR: torch.Tensor, proj_RI: torch.Tensor, *,
               lr: float, wd: float, device: torch.device) -> None:
    """The trainer's merge call on ``block_OI`` (in host memory), run on ``device`` (the kind the
    trainer merges on: :mod:`megatron_logra.sync.replay_device`)."""
    if device.type == "cpu":
        apply_low_rank_update_(block_OI, factor_OR, proj_RI, lr=lr, weight_decay=wd)
        return
    on_device = block_OI.to(device)
    apply_low_rank_update_(on_device, factor_OR.to(device), proj_RI.to(device), lr=lr,
                           weight_decay=wd)
    block_OI.copy_(on_device.cpu())


def _merge_piece_(master_OI: torch.Tensor, shard: TensorShard, full_shape: tuple[int, int],
                  update: LowRankUpdate, piece: FactorPiece,
                  device: torch.device = HOST) -> None:
    """One trainer merge call, replayed on a block of the same shape (so: the same rounding),
    on the part of the piece this shard holds.

    * The piece lies inside the shard (every row and column of it): its block is gathered from
      the shard and merged with the piece's own columns of A only.
    * The shard holds part of the piece (the engine's TP cuts the trainer's block): the merge
      runs at the piece's full shape on a scratch block holding the shard's entries (zeros
      elsewhere), and the shard keeps its entries. A GEMM computes each output entry from its
      own row of F, column of A and entry of W, so at the same shape the kept entries get the
      trainer's bits whatever the other entries hold; a merge at the sub-block's own shape may
      not (CPU BLAS picks kernels by shape: 8-column slices of a 96 x 64 merge differed in 432
      of 768 entries). The scratch block is transient: one piece, not the shadow.
    """
    lr, wd = update.lr, update.weight_decay
    factor_OR = piece.factor_OR.float()
    s_lo, s_hi = shard.columns(full_shape[1])
    c_lo, c_hi = max(piece.col_start, s_lo), min(piece.col_end, s_hi)
    if c_lo >= c_hi:
        return  # none of the piece's columns are here
    local = shard.local_rows(full_shape[0])[
        torch.cat([torch.arange(lo, hi) for lo, hi in piece.row_ranges])]
    held = local >= 0
    if not bool(held.any()):
        return
    cols = slice(c_lo - s_lo, c_hi - s_lo)
    proj_RI = regenerate_projection(update, piece.col_start, piece.col_end)
    inside = bool(held.all()) and (c_lo, c_hi) == (piece.col_start, piece.col_end)
    if inside and torch.equal(local, torch.arange(master_OI.shape[0])) and (
            cols == slice(0, master_OI.shape[1])):
        _merge_on_(master_OI, factor_OR, proj_RI, lr=lr, wd=wd, device=device)
        return
    # The piece's block: gathered whole from the shard, or a scratch block at the piece's shape
    # holding the shard's entries; either way only the shard's entries are written back.
    piece_cols = slice(c_lo - piece.col_start, c_hi - piece.col_start)
    if inside:
        block_OI = master_OI[local, cols].contiguous()
    else:
        block_OI = torch.zeros(local.numel(), piece.col_end - piece.col_start)
        block_OI[held, piece_cols] = master_OI[local[held], cols]
    _merge_on_(block_OI, factor_OR, proj_RI, lr=lr, wd=wd, device=device)
    master_OI[local[held], cols] = block_OI[held, piece_cols]


class EngineShadow:
    """fp32 shadows of the target weights and the served weights cast from them.

    Args:
        target_names: parameter names of the LoGRA targets (``<layer_key>.weight``).
        served_dtype: the dtype the engine computes with (the trainer's parameter dtype).
        shards: the part of each named tensor this engine rank keeps (its TP shard); a name
            without one is kept whole. Records still address the full (TP=1) tensors: the
            shadow slices what arrives and replays only the merges that touch its shard.
        replay_device: where merges run (the shadow stays in host memory): a device of the
            kind the trainer merges on (:mod:`megatron_logra.sync.replay_device`).
    """

    def __init__(self, target_names: Iterable[str], *, served_dtype: torch.dtype,
                 shards: Mapping[str, TensorShard] | None = None,
                 replay_device: torch.device = HOST) -> None:
        self.target_names = frozenset(target_names)
        self.replay_device = replay_device
        self.served_dtype = served_dtype
        self.shards: dict[str, TensorShard] = dict(shards or {})
        self.masters: dict[str, torch.Tensor] = {}
        self.served: dict[str, torch.Tensor] = {}
        """Per name, the served tensor of this rank's shard (the full tensor without one)."""
        self.full_shapes: dict[str, tuple[int, ...]] = {}
        self.counts: dict[str, int] = {}
        self._pending: list[FullSyncBucket] = []

    def invalidate(self) -> None:
        """Forget every weight: after a failure that left the served model and the shadow apart,
        every record but a full sync is refused (naming the missing full sync)."""
        self.masters, self.served, self.full_shapes, self.counts = {}, {}, {}, {}
        self._pending = []

    def shard_of(self, name: str, full_shape: tuple[int, ...]) -> TensorShard:
        shard = self.shards.get(name) or whole(full_shape)
        shard.check(full_shape, name)
        return shard

    # ------------------------------------------------------------------ records

    def apply(self, record: SyncRecord | DeltaBucket) -> list[str]:
        """Apply one record; the names whose served tensor it changed (a full sync's: none until
        its last bucket, then all)."""
        if isinstance(record, LowRankUpdate):
            self.apply_low_rank(record)
            return [record.param_name]
        if isinstance(record, DenseUpdate):
            self.apply_dense(record)
            return [record.name]
        if isinstance(record, FullSyncBucket):
            self.apply_full_bucket(record)
            return [] if self._pending else list(self.served)
        if isinstance(record, DeltaBucket):
            self.apply_delta(record)
            return list(record.tensors)
        raise TypeError(f"not a sync record: {type(record).__name__}")

    def apply_delta(self, bucket: DeltaBucket) -> None:
        """XOR each tensor's bits into what this engine holds of it: the fp32 master of a target
        it shadows (then the served cast is redone), the served tensor otherwise; this rank's
        shard of it. Every tensor is checked (known, at its base count, dtype and shape, frame
        and digest) before any changes."""
        xors = {}
        for name, delta in bucket.tensors.items():
            held = self.masters.get(name, self.served.get(name))
            if held is None:
                raise RuntimeError(f"refusing delta of {name}: the engine holds no such weight "
                                   "(no full sync yet, or an unknown name)")
            if delta.base_count != self.counts[name] or bucket.update_count <= delta.base_count:
                raise RuntimeError(
                    f"refusing delta of {name} to update {bucket.update_count}: it is against "
                    f"update {delta.base_count}, the engine holds update {self.counts[name]} "
                    f"({'repeated' if bucket.update_count <= self.counts[name] else 'out of order'}"
                    "); request a full sync")
            full_shape = self.full_shapes[name]
            dtype = str(held.dtype).removeprefix("torch.")
            if (delta.dtype, delta.shape) != (dtype, full_shape):
                raise RuntimeError(
                    f"refusing delta of {name}: it is of a {delta.dtype} {delta.shape} tensor, "
                    f"the engine holds {dtype} {full_shape}"
                    + (" (its fp32 master: the trainer must XOR the master)"
                       if name in self.masters else ""))
            xors[name] = self.shard_of(name, full_shape).take(decoded_xor(name, delta))
        for name, xor in xors.items():
            if name in self.masters:
                apply_xor_(self.masters[name], xor)
                self.served[name] = self._cast(self.masters[name])
            else:
                apply_xor_(self.served[name], xor)
            self.counts[name] = bucket.update_count

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
        unknown = sorted(self.shards.keys() - tensors.keys())
        if unknown:
            raise RuntimeError(f"full sync lacks weights the engine shards: {unknown[:4]}")
        masters, served, shapes = {}, {}, {}
        for name, tensor in tensors.items():
            shapes[name] = tuple(tensor.shape)
            part = self.shard_of(name, shapes[name]).take(tensor)
            if name in self.target_names:
                if tensor.dtype != torch.float32:
                    raise RuntimeError(
                        f"full sync sent {name} as {tensor.dtype}; targets travel as their fp32 "
                        "master (the shadow must start from the exact state)"
                    )
                masters[name] = part
                served[name] = self._cast(masters[name])
            else:
                served[name] = part.to(self.served_dtype)
        self.masters, self.served, self.full_shapes = masters, served, shapes
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
        master_OI, full_shape = self.masters[name], self.full_shapes[name]
        if full_shape[1] != update.in_features:
            raise RuntimeError(f"{update.layer_key}: shadow has {full_shape[1]} input "
                               f"columns, the update {update.in_features}")
        for piece in update.pieces:  # check all before changing anything
            self._check_piece(update, piece, full_shape)
        shard = self.shard_of(name, full_shape)
        for piece in update.pieces:
            _merge_piece_(master_OI, shard, full_shape, update, piece, self.replay_device)
        self.served[name] = self._cast(master_OI)
        self.counts[name] = expected

    @staticmethod
    def _check_piece(update: LowRankUpdate, piece: FactorPiece, shape: tuple[int, ...]) -> None:
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
        full_shape = self.full_shapes[update.name]
        if tuple(update.value.shape) != full_shape:
            raise RuntimeError(f"dense update of {update.name} has shape "
                               f"{tuple(update.value.shape)}, the engine {full_shape}")
        self.served[update.name].copy_(self.shard_of(update.name, full_shape).take(update.value))
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

    def nbytes(self) -> int:
        """Bytes the shadow holds: the fp32 masters and every served tensor that is not one."""
        masters = {id(t) for t in self.masters.values()}
        return (sum(t.nbytes for t in self.masters.values())
                + sum(t.nbytes for t in self.served.values() if id(t) not in masters))

    def checksums(self) -> dict[str, str]:
        """Digests of the served weights (:func:`megatron_logra.sync.checksum.weight_checksum`)."""
        return weight_checksums(self.served.items())
