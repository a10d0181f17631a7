"""The seam between an optimizer's proposed low-rank update and whatever sizes it.

An optimizer built with a :class:`StepScale` prepares its update, hands the controller a
:class:`ProposedUpdate` and applies the update times the scale it gets back; it never asks the
controller anything else, and the controller never reaches into the optimizer. The controller's
state travels in the optimizer's checkpoint (``state_dict`` / ``load_state_dict``), so a resumed
run continues the same schedule. The predicted-KL step control
(``megatron_logra.mcore.kl_probe.step_control``) is one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class ProposedUpdate:
    """A prepared update before it is applied.

    Attributes:
        directions: ``{layer_key: (left, right)}``; ``left @ right`` is this rank's local change
            of that target weight at scale 1 (weight decay aside): ``left = -lr D`` (all of the
            layer's local rows, also when the masters are sharded over DP), ``right = A`` (its
            local column slice for a row-parallel layer).
        completed_updates: updates applied before this one.
    """

    directions: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    completed_updates: int


class StepScale(Protocol):
    """Chooses the scale of a proposed update (collective: every rank calls it and gets the
    same number)."""

    def __call__(self, proposal: ProposedUpdate) -> float: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
