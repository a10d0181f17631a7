"""RowAdam: a per-output-row second moment that turns a sketch into an update direction.

The sketch's columns are coordinates in a random subspace that is redrawn every step, so no
per-coordinate statistic survives from one step to the next; the output row index does. RowAdam
keeps one scalar per row of ``W`` (library mode, as the reference library ships it):

    v_i   <- beta2 * v_i + (1 - beta2) * mean_j S_ij^2
    vhat_i = v_i / (1 - beta2^t)                      (t = 1-based update count)
    D_i    = S_i / (sqrt(vhat_i) + eps)

At t = 1 the direction is exactly scale-invariant (``vhat_i = mean_j S_ij^2``). There is no
first moment: a new projection every step would make one meaningless.

Shape suffixes: O = output rows (m), R = sketch rank (r).
"""

from __future__ import annotations

import torch


def update_row_second_moment_(
    second_moment_O: torch.Tensor, sketch_OR: torch.Tensor, *, beta2: float
) -> None:
    """``v <- beta2 v + (1 - beta2) mean_j S_j^2`` in place (fp32)."""
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"RowAdam beta2 must be in [0, 1), got {beta2}")
    row_mean_sq_O = sketch_OR.pow(2).mean(dim=1).to(second_moment_O.dtype)
    second_moment_O.mul_(beta2).add_(row_mean_sq_O, alpha=1.0 - beta2)


def row_adam_direction(
    sketch_OR: torch.Tensor,
    second_moment_O: torch.Tensor,
    *,
    step: int,
    beta2: float,
    eps: float,
) -> torch.Tensor:
    """Update ``second_moment_O`` in place and return the direction ``D [m, r]``.

    The direction has the sketch's dtype (fp32 in training, fp64 in reference computations).

    Args:
        sketch_OR: the step's reduced (and possibly clipped) sketch.
        second_moment_O: the row moment, updated in place.
        step: 1-based count of updates including this one (for bias correction).
    """
    if step < 1:
        raise ValueError(f"RowAdam step is 1-based, got {step}")
    update_row_second_moment_(second_moment_O, sketch_OR, beta2=beta2)
    bias_correction = 1.0 - beta2**step
    denom_O = (second_moment_O / bias_correction).sqrt_().add_(eps)
    return sketch_OR / denom_O.to(sketch_OR.dtype)[:, None]
