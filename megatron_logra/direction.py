"""Direction rules: how a step's reduced sketches become update factors ``D``.

A rule transforms every sketch view of a :class:`FlatSketchBuffer` into its direction in place
(the sketch is not needed once the direction exists, and the in-place form saves a buffer the
size of all sketches). The optimizer then merges ``-lr * D A`` into the weights.

``sgd`` (D = S), ``row_adam`` (library RowAdam) and ``paper_row_adam`` (the paper's RowAdam:
relative floor, row-scale normalisation, layer-norm restoration) live here. The paper's global
update-ratio normalisation needs the weights and projections, so the optimizer applies it after
the rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megatron_logra.config import DIRECTIONS
from megatron_logra.row_adam import row_adam_direction
from megatron_logra.row_adam_paper import PaperRowAdamLayer, paper_row_adam_
from megatron_logra.sketch_buffer import FlatSketchBuffer


@dataclass(frozen=True)
class DirectionContext:
    """What a rule may need besides the sketches.

    Attributes:
        step: 1-based number of the update being prepared.
        row_groups: for rules with statistics over a layer's rows: the process group holding
            the rows of complete (column-parallel) layers, keyed False, and of row-parallel
            layers, keyed True (None: the rank holds all rows).
        expert_row_groups: the same for routed experts' layers (their rows are sharded over
            the expert-data-parallel group, not DP); a value may be a tuple of groups, reduced
            over in turn.
    """

    step: int
    row_groups: Mapping[bool, Any] = field(default_factory=dict)
    expert_row_groups: Mapping[bool, Any] = field(default_factory=dict)


class DirectionRule(Protocol):
    """Turns sketches into directions in place and owns any per-row state."""

    name: str

    def apply_(self, sketches: FlatSketchBuffer, context: DirectionContext) -> None: ...

    def state_tensors(self) -> Mapping[str, torch.Tensor]: ...


class SgdDirection:
    """``D = S``: plain (projected) gradient descent; with ``A = I`` it is Megatron's SGD."""

    name = "sgd"

    def apply_(self, sketches: FlatSketchBuffer, context: DirectionContext) -> None:
        del sketches, context

    def state_tensors(self) -> Mapping[str, torch.Tensor]:
        return {}


class RowAdamDirection:
    """Library-mode RowAdam (see :mod:`megatron_logra.row_adam`) over every slot of a buffer.

    The row moments of all layers are one flat fp32 tensor (``row_second_moment``) in slot
    order, so checkpointing and memory accounting see a single state tensor. It covers the rows
    this rank owns: all of them, or a 1/dp share when masters are DP-sharded.
    """

    name = "row_adam"

    def __init__(self, sketches: FlatSketchBuffer, *, beta2: float, eps: float) -> None:
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"logra.beta2 must be in [0, 1), got {beta2}")
        if eps <= 0.0:
            raise ValueError(f"logra.eps must be positive, got {eps}")
        self.beta2 = beta2
        self.eps = eps
        # One moment per row this rank owns (all rows unless masters are DP-sharded).
        owned = [(slot, view.shape[0]) for slot, view in sketches.owned_items()]
        self.row_second_moment = torch.zeros(
            sum(rows for _, rows in owned), dtype=torch.float32, device=sketches.data.device
        )
        self._moments: dict[str, torch.Tensor] = {}
        offset = 0
        for slot, rows in owned:
            self._moments[slot.layer_key] = self.row_second_moment[offset : offset + rows]
            offset += rows

    def moment(self, layer_key: str) -> torch.Tensor:
        return self._moments[layer_key]

    def apply_(self, sketches: FlatSketchBuffer, context: DirectionContext) -> None:
        for slot, sketch_OR in sketches.owned_items():
            direction_OR = row_adam_direction(
                sketch_OR,
                self._moments[slot.layer_key],
                step=context.step,
                beta2=self.beta2,
                eps=self.eps,
            )
            sketch_OR.copy_(direction_OR)

    def state_tensors(self) -> Mapping[str, torch.Tensor]:
        return {"row_second_moment": self.row_second_moment}


class PaperRowAdamDirection(RowAdamDirection):
    """The paper's RowAdam (relative floor, RMS-normalised row scales, layer-norm restoration;
    see :mod:`megatron_logra.row_adam_paper`). Same row-moment state as library RowAdam; its
    per-layer statistics are reduced over ``context.row_groups``."""

    name = "paper_row_adam"

    def apply_(self, sketches: FlatSketchBuffer, context: DirectionContext) -> None:
        layers = [
            PaperRowAdamLayer(view, self.moment(slot.layer_key),
                              (context.expert_row_groups if slot.expert
                               else context.row_groups).get(slot.tp_partial))
            for slot, view in sketches.owned_items()
        ]
        paper_row_adam_(layers, step=context.step, beta2=self.beta2, eps=self.eps)


# One rule per name of megatron_logra.config.DIRECTIONS.
DIRECTION_RULES: dict[str, Callable[..., DirectionRule]] = {
    "sgd": lambda sketches, *, beta2, eps: SgdDirection(),
    "row_adam": RowAdamDirection,
    "paper_row_adam": PaperRowAdamDirection,
}


def make_direction_rule(
    name: str, sketches: FlatSketchBuffer, *, beta2: float, eps: float
) -> DirectionRule:
    """Build the rule named by ``logra.direction``."""
    if name not in DIRECTION_RULES:
        raise ValueError(f"logra.direction={name!r} is not one of {DIRECTIONS}")
    return DIRECTION_RULES[name](sketches, beta2=beta2, eps=eps)
