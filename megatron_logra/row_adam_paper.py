"""The LoGRA paper's RowAdam direction (the authors' implementation), layout independent.

Per target layer, with S the step's reduced sketch (our sketch is already the gradient of the
global token-mean loss, i.e. the authors' ``S / N_tokens``):

1. ``v_i <- beta2 v_i + (1 - beta2) mean_j S_ij^2``;  ``rho_i = sqrt(v_i / (1 - beta2^t))``
2. relative floor: ``d_i = rho_i + max(eps * mean_k rho_k, tiny)``
3. inverse row scales ``c_i = min_k d_k / d_i``, RMS-normalised: ``c <- c / sqrt(mean_i c_i^2)``
4. ``D' = diag(c) S``, then the layer's sketch norm is restored: ``D = D' ||S||_F / ||D'||_F``
   (an all-zero sketch gives D = 0).

The means, the minimum and the norms run over *all* rows of the layer, which tensor parallelism
(column-parallel layers) and DP-sharded masters split over ranks. Each layer's row statistics are
therefore reduced over the group that holds its rows (``row_group``), batched into one
collective per statistic for all layers that share a group. The result equals the single-process
computation up to the summation order.

Shape suffixes: O = rows this rank owns, R = sketch rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

_TINY = torch.finfo(torch.float32).tiny


def blockwise_sq_norm(blocks: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sum ||block||_F^2`` as a float64 scalar, one block's float64 copy alive at a time.

    The square of an fp32 (or bf16) value is exact in float64 (48 of 53 significand bits), so
    this differs from the float64 reference ``W.double().pow(2).sum()`` only by the order of
    the float64 additions.
    """
    total = None
    for block in blocks:
        part = block.double().pow_(2).sum()
        total = part if total is None else total + part
    if total is None:
        raise ValueError("blockwise_sq_norm got no blocks; pass the weight's row blocks")
    return total


@dataclass
class PaperRowAdamLayer:
    """One layer's rows on this rank: the reduced sketch (overwritten with the direction) and the
    row second moments, plus the group over which the layer's rows are spread."""

    sketch_OR: torch.Tensor
    moment_O: torch.Tensor
    row_group: dist.ProcessGroup | tuple[dist.ProcessGroup, ...] | None
    """A tuple when the rows are split over several groups (a sharded expert's: expert TP,
    then expert-DP): every statistic is a sum or a minimum, reduced over each in turn."""


def _reduce(values: torch.Tensor, group: dist.ProcessGroup | tuple[dist.ProcessGroup, ...] | None,
            op: dist.ReduceOp) -> None:
    for one in group if isinstance(group, tuple) else (group,):
        if one is not None and dist.is_initialized() and dist.get_world_size(one) > 1:
            dist.all_reduce(values, op=op, group=one)


def _per_group(layers: Sequence[PaperRowAdamLayer]) -> dict[int, list[int]]:
    """Layer indices by their row group (identity of the group object)."""
    by_group: dict[int, list[int]] = {}
    for index, layer in enumerate(layers):
        by_group.setdefault(id(layer.row_group), []).append(index)
    return by_group


def _layer_reduce(
    layers: Sequence[PaperRowAdamLayer], values: torch.Tensor, op: dist.ReduceOp
) -> torch.Tensor:
    """Reduce one float64 statistic per layer over each layer's row group (in place)."""
    for indices in _per_group(layers).values():
        part = values[indices].clone()
        _reduce(part, layers[indices[0]].row_group, op)
        values[indices] = part
    return values


@torch.no_grad()
def paper_row_adam_(
    layers: Sequence[PaperRowAdamLayer], *, step: int, beta2: float, eps: float
) -> None:
    """Turn every layer's sketch into the paper's direction in place; update the moments."""
    if step < 1:
        raise ValueError(f"RowAdam step is 1-based, got {step}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"logra.beta2 must be in [0, 1), got {beta2}")
    if not layers:
        return
    device = layers[0].sketch_OR.device
    count = len(layers)
    rho: list[torch.Tensor] = []
    rows = torch.zeros(count, dtype=torch.float64, device=device)
    rho_sum = torch.zeros(count, dtype=torch.float64, device=device)
    sketch_sq = torch.zeros(count, dtype=torch.float64, device=device)
    bias_correction = 1.0 - beta2**step
    for index, layer in enumerate(layers):
        # Row statistics in float64 (per-row scalars: cheap); the moment keeps its dtype.
        sketch = layer.sketch_OR.double()
        layer.moment_O.mul_(beta2).add_(
            sketch.pow(2).mean(dim=1).to(layer.moment_O.dtype), alpha=1.0 - beta2
        )
        rho_O = (layer.moment_O.double() / bias_correction).sqrt()
        rho.append(rho_O)
        rows[index] = rho_O.numel()
        rho_sum[index] = rho_O.double().sum()
        sketch_sq[index] = sketch.pow(2).sum()
    stacked = torch.stack([rows, rho_sum, sketch_sq])
    for indices in _per_group(layers).values():
        part = stacked[:, indices].clone()
        _reduce(part, layers[indices[0]].row_group, dist.ReduceOp.SUM)
        stacked[:, indices] = part
    rows, rho_sum, sketch_sq = stacked
    floors = torch.clamp(eps * rho_sum / rows, min=_TINY)
    denoms = [rho_O + float(floor) for rho_O, floor in zip(rho, floors, strict=True)]
    min_denom = torch.stack([d.min() for d in denoms])
    _layer_reduce(layers, min_denom, dist.ReduceOp.MIN)
    scales = [float(m) / d for m, d in zip(min_denom, denoms, strict=True)]
    scale_sq = torch.stack([c.pow(2).sum() for c in scales])
    _layer_reduce(layers, scale_sq, dist.ReduceOp.SUM)
    scales = [c / float(torch.sqrt(q / n)) for c, q, n in zip(scales, scale_sq, rows, strict=True)]
    scaled_sq = torch.stack(
        [(layer.sketch_OR.double() * c[:, None]).pow(2).sum()
         for layer, c in zip(layers, scales, strict=True)]
    )
    _layer_reduce(layers, scaled_sq, dist.ReduceOp.SUM)
    for layer, c, s_sq, d_sq in zip(layers, scales, sketch_sq, scaled_sq, strict=True):
        if float(d_sq) == 0.0:
            layer.sketch_OR.zero_()
            continue
        restore = float(torch.sqrt(s_sq / d_sq))
        layer.sketch_OR.mul_((c * restore).to(layer.sketch_OR.dtype)[:, None])


def update_ratio_scale(
    weight_sq_norm: float, direction_sq_norm: float, update_ratio: float
) -> float:
    """kappa such that ``||kappa * sum_l D_l A_l|| = update_ratio * ||W_targets||``.

    Both norms are global (every target layer, every rank's share counted once).
    """
    if not (direction_sq_norm >= 0.0 and weight_sq_norm >= 0.0):
        raise RuntimeError(
            f"non-finite or negative norms in the update-ratio normalisation: "
            f"||W||^2={weight_sq_norm}, ||DA||^2={direction_sq_norm}"
        )
    if direction_sq_norm == 0.0:
        return 0.0
    return update_ratio * (weight_sq_norm / direction_sq_norm) ** 0.5
