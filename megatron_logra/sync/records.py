"""The records of low-rank policy sync (docs/sync.md).

One LoGRA update of one target layer is merged by the trainer as
``W <- (1 - lr wd) W - lr F A`` (:func:`megatron_logra.sketch.apply_low_rank_update_`), where
``F`` is the factor as merged (the direction D, or the paper mode's bf16-rounded ``alpha D``) and
``A`` the layer's projection for that update. The record carries ``F``, ``lr`` and ``wd`` as the
merge takes them -- not the product ``U = lr F``: the merge computes ``lr * (F A)`` in one
``addmm``, and a pre-multiplied ``U A`` rounds differently -- plus what regenerates ``A``
(seed, projection count, layer key, distribution, sketch rank, global column range).

A record holds the factor rows of one or more trainer ranks (:class:`FactorPiece`): the rows of
the full (TP=1) weight that a rank's master covers (all rows; a column-parallel TP shard's rows;
its DP-sharded row chunks) and the global input columns its weight covers (a row-parallel TP
shard's slice). The engine replays each piece as one merge call on a block of the same shape,
so it reproduces the trainer's rounding exactly, whatever the trainer's layout.

Shape suffixes: O = rows of a piece, R = sketch rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

PROJECTION_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}
"""The dtype the trainer rounded A through before merging (its compute dtype)."""


def host_factor(factor_OR: torch.Tensor) -> torch.Tensor:
    """A copy of a merged factor in host memory, for a record.

    The trainer merges on its own device and reuses the factor's buffer (the sketch) in the next
    step, so a record keeps a copy; on the host, because a record is gathered over the trainer's
    ranks (a pickled CUDA tensor would unpickle onto the sender's device number in every
    process), compared across ranks and encoded from raw bytes (``.numpy()`` refuses device
    memory)."""
    return factor_OR.detach().to("cpu", copy=True)


@dataclass(frozen=True)
class FactorPiece:
    """Factor rows of one trainer rank.

    Attributes:
        row_ranges: ``(lo, hi)`` ranges of the full (TP=1) weight's rows, in the order the
            factor's rows follow them (one range per stride block: a gated fc1's TP shard or
            DP-sharded master holds a gate and an up range).
        col_start, col_end: the global input columns of the weight the piece is merged into
            (a row-parallel TP shard covers a slice; otherwise ``0, in_features``).
        factor_OR: ``F`` as merged, fp32 (or the wire dtype after decoding), on the host
            (:func:`host_factor`).
    """

    row_ranges: tuple[tuple[int, int], ...]
    col_start: int
    col_end: int
    factor_OR: torch.Tensor

    def __post_init__(self) -> None:
        if self.factor_OR.device.type != "cpu":
            raise ValueError(
                f"a factor piece of rows {self.row_ranges} holds a tensor on "
                f"{self.factor_OR.device}: records are gathered between processes and encoded "
                "as raw bytes, which needs host memory; build it with host_factor(factor)")
        rows = sum(hi - lo for lo, hi in self.row_ranges)
        if self.factor_OR.dim() != 2 or self.factor_OR.shape[0] != rows:
            raise ValueError(
                f"factor of shape {tuple(self.factor_OR.shape)} does not cover the {rows} rows "
                f"of {self.row_ranges}"
            )


@dataclass(frozen=True)
class LowRankUpdate:
    """Update number ``update_count`` (1-based) of one target layer.

    Attributes:
        layer_key: the layer's stable key (``decoder.layers.<i>.<path>``); its weight is the
            parameter ``<layer_key>.weight``.
        update_count: this update's number; the engine applies 1, 2, 3, ... per layer.
        seed, projection_count: ``projection_key(seed, projection_count, layer_key)`` seeds A
            (``projection_count`` is ``update_count - 1`` with refreshed projections, else 0).
        distribution, sketch_rank, in_features: the rest of A's definition (global width n).
        projection_dtype: ``float32``, ``bfloat16`` or ``float16``: A is rounded through it
            before the merge, as the trainer does for low-precision weights.
        lr, weight_decay: the merge's scalars (``W <- (1 - lr wd) W - lr F A``).
        pieces: the factor rows, one piece per contributing trainer rank.
    """

    layer_key: str
    update_count: int
    seed: int
    projection_count: int
    distribution: str
    sketch_rank: int
    in_features: int
    projection_dtype: str
    lr: float
    weight_decay: float
    pieces: tuple[FactorPiece, ...]

    def __post_init__(self) -> None:
        if self.update_count < 1:
            raise ValueError(f"update_count counts from 1, got {self.update_count}")
        if self.projection_dtype not in PROJECTION_DTYPES:
            raise ValueError(f"projection_dtype {self.projection_dtype!r} is not one of "
                             f"{sorted(PROJECTION_DTYPES)}")

    @property
    def param_name(self) -> str:
        return f"{self.layer_key}.weight"


@dataclass(frozen=True)
class DenseUpdate:
    """The new value of a non-target parameter that changed in update ``update_count``.

    Dense values are absolute, so the engine accepts gaps (a parameter that did not change
    ships nothing) but refuses a repeated or older update.
    """

    name: str
    update_count: int
    value: torch.Tensor


@dataclass(frozen=True)
class FullSyncBucket:
    """One bucket of a full sync after ``update_count`` updates (0: the initial weights).

    ``tensors`` maps parameter names to their exact training state: the fp32 master of a target
    whose weights are bf16 (the engine's shadow must start from it, not from the rounded weight),
    the weight itself otherwise.
    """

    update_count: int
    index: int
    num_buckets: int
    tensors: dict[str, torch.Tensor]


SyncRecord = LowRankUpdate | DenseUpdate | FullSyncBucket


def full_sync_buckets(
    tensors: dict[str, torch.Tensor], *, update_count: int, bucket_bytes: int
) -> list[FullSyncBucket]:
    """Split named tensors into buckets of at most ``bucket_bytes`` (one oversized tensor gets a
    bucket of its own), in the dict's order."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > bucket_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensor.detach().clone()
        size += nbytes
    return [
        FullSyncBucket(update_count=update_count, index=i, num_buckets=len(groups), tensors=group)
        for i, group in enumerate(groups)
    ]


def combine_rank_records(per_rank: list[list[LowRankUpdate]]) -> list[LowRankUpdate]:
    """One record per layer from the records of every trainer rank: their pieces in rank order.

    Replicas (DP ranks of unsharded weights) hold the same block of the weight: applying it
    twice would apply the update twice, so a piece whose block was seen is dropped -- after
    checking that its factor is the same bits.
    """
    combined: dict[str, LowRankUpdate] = {}
    for records in per_rank:
        for record in records:
            seen = combined.get(record.layer_key)
            if seen is None:
                combined[record.layer_key] = record
                continue
            if dataclasses.replace(seen, pieces=()) != dataclasses.replace(record, pieces=()):
                raise ValueError(f"ranks disagree on update {record.update_count} of "
                                 f"{record.layer_key}: {seen} vs {record}")
            blocks = {(p.row_ranges, p.col_start, p.col_end): p for p in seen.pieces}
            new = []
            for piece in record.pieces:
                replica = blocks.get((piece.row_ranges, piece.col_start, piece.col_end))
                if replica is None:
                    new.append(piece)
                elif not torch.equal(replica.factor_OR, piece.factor_OR):
                    raise ValueError(f"replicas of {record.layer_key} rows {piece.row_ranges} "
                                     f"differ in update {record.update_count}")
            combined[record.layer_key] = dataclasses.replace(
                seen, pieces=seen.pieces + tuple(new))
    return list(combined.values())
