"""LoGRA's two modes as strategy objects, chosen once from ``logra.mode`` (:func:`logra_mode`).

``library`` (NeMo Automodel style): the direction ``D`` is merged with the learning rate and the
weight decay of the LR schedule, ``W <- (1 - lr wd) W - lr D A``; gradients are clipped by one
global norm that counts each sketch as the gradient it stands for (``S A``); every non-target
parameter is trained by Megatron's own optimizer.

``paper`` (the authors' method): no learning rate and no weight decay; all directions are scaled
jointly so that the proposed update has Frobenius norm ``update_ratio * ||W_targets||``; no
clipping; every non-target parameter frozen; the reported gradient norm is the paper's
``sqrt(sum ||S||^2)``; the scaled factor ``alpha D`` is rounded to ``update_factor_dtype`` before
the merge, as the paper's runs do.

Everything that differs between the modes is a method here, so the optimizer, the training setup
and the trainers ask the mode instead of testing its name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from megatron_logra.config import LoGRAConfig
from megatron_logra.row_adam_paper import update_ratio_scale


class LibraryMode:
    name = "library"
    default_direction = "row_adam"
    trains_non_targets = True
    clips_gradients = True

    def direction(self, requested: str) -> str:
        """The direction rule: ``logra.direction``, or the mode's own for ``auto``."""
        return self.default_direction if requested == "auto" else requested

    def step_size(self, lr: float, weight_decay: float) -> tuple[float, float]:
        """``(lr, weight_decay)`` of the merge, from the scheduler's values."""
        return lr, weight_decay

    def proposal_scale(
        self, weight_sq_norm: Callable[[], float], direction_sq_norm: Callable[[], float]
    ) -> float | None:
        """The joint scale of the prepared directions (None: left as they are)."""
        del weight_sq_norm, direction_sq_norm
        return None

    def merge_factor(
        self, direction_OR: torch.Tensor, scale: float, lr: float
    ) -> tuple[torch.Tensor, float]:
        """``(factor, step_lr)`` with ``W <- (1 - step_lr wd) W - step_lr factor A``."""
        return direction_OR, lr * scale

    def grad_norm(
        self, *, native_norm: Callable[[], float], reconstructed_sq_norm: Callable[[], float],
        sketch_frobenius_sq: Callable[[], float],
    ) -> float:
        """One global norm: Megatron's over the native parameters and ``||S A||`` over the
        sketched ones."""
        del sketch_frobenius_sq
        return math.sqrt(float(native_norm()) ** 2 + reconstructed_sq_norm())

    def step_metrics(self, lr: float) -> dict[str, Any]:
        return {"lr": lr}

    def fingerprint(self) -> dict[str, Any]:
        """Settings this mode's checkpointed state depends on."""
        return {"update_ratio": None}


class PaperMode:
    name = "paper"
    default_direction = "paper_row_adam"
    trains_non_targets = False
    clips_gradients = False

    def __init__(self, *, update_ratio: float, update_factor_dtype: str) -> None:
        self.update_ratio = update_ratio
        self.round_factor = update_factor_dtype == "bf16"

    def direction(self, requested: str) -> str:
        return self.default_direction if requested == "auto" else requested

    def step_size(self, lr: float, weight_decay: float) -> tuple[float, float]:
        # No learning rate (the update ratio and the KL controller's alpha size the step) and
        # no weight decay.
        del lr, weight_decay
        return 1.0, 0.0

    def proposal_scale(
        self, weight_sq_norm: Callable[[], float], direction_sq_norm: Callable[[], float]
    ) -> float | None:
        return update_ratio_scale(weight_sq_norm(), direction_sq_norm(), self.update_ratio)

    def merge_factor(
        self, direction_OR: torch.Tensor, scale: float, lr: float
    ) -> tuple[torch.Tensor, float]:
        if self.round_factor:
            # The paper's runs round the scaled factor to bf16; the scale is folded into it.
            return (direction_OR * scale).to(torch.bfloat16).float(), lr
        return direction_OR, lr * scale

    def grad_norm(
        self, *, native_norm: Callable[[], float], reconstructed_sq_norm: Callable[[], float],
        sketch_frobenius_sq: Callable[[], float],
    ) -> float:
        # The paper reports the sketch norm sqrt(sum ||S||^2); nothing else is trained.
        del native_norm, reconstructed_sq_norm
        return math.sqrt(sketch_frobenius_sq())

    def step_metrics(self, lr: float) -> dict[str, Any]:
        del lr
        return {"lr": None, "update_ratio": self.update_ratio}

    def fingerprint(self) -> dict[str, Any]:
        return {"update_ratio": self.update_ratio}


LoGRAMode = LibraryMode | PaperMode


def logra_mode(logra: LoGRAConfig) -> LoGRAMode:
    """The strategy object of ``logra.mode``."""
    if logra.mode == "paper":
        return PaperMode(update_ratio=logra.update_ratio,
                         update_factor_dtype=logra.update_factor_dtype)
    return LibraryMode()
