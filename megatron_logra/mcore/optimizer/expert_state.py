"""What LoGRA does differently for the routed experts of an MoE model.

Two things, both kept out of the optimizer's main path:

* **Statistics.** A model-wide sum (the sketch norm for clipping, ``||W||`` for the paper's
  ratio, zero counts) adds each rank's share once. Dense targets are distinct over tensor x
  pipeline parallelism and replicated over DP; an expert's shards are distinct over expert
  tensor x expert x pipeline parallelism (different EP ranks hold different experts) and
  replicated over the expert-data-parallel group. :func:`model_sum` reduces the two parts over
  their own groups.
* **Experts that received no tokens.** Such an expert has no gradient signal in the step: its
  sketch is exactly zero on every rank that holds it. It gets no update -- no merge, no weight
  decay -- and its row moments stay as they were (a RowAdam moment would otherwise decay towards
  zero and inflate the expert's next step). Whether an expert received tokens is decided from
  the token rows its sketch accumulated, summed over the expert-data-parallel group, so every
  rank holding the expert agrees. (RowAdam's bias correction keeps the global update count: an
  expert that was idle for some steps is corrected as if its moment had been updated; the same
  holds for Megatron's Adam, which still decays an idle expert's moments.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_logra.mcore.models.targets import SketchTarget
from megatron_logra.mcore.process_groups import ParallelGroups
from megatron_logra.sketch_buffer import FlatSketchBuffer


def model_sum(
    targets: Sequence[SketchTarget],
    per_target: Callable[[SketchTarget], torch.Tensor | float],
    *,
    stats_group: dist.ProcessGroup | None,
    expert_group: dist.ProcessGroup | None,
    device: torch.device,
    model_has_experts: bool,
) -> float:
    """``sum over the model`` of ``per_target``: dense targets' shares summed over
    ``stats_group``, experts' over ``expert_group`` (None: the whole world, where every rank
    holds a distinct share -- sharded masters). Collective: the same calls on every rank; in
    an MoE model (``model_has_experts``) that includes the ranks without experts (a pipeline
    stage of dense layers only), which add zero."""
    dense = torch.zeros((), dtype=torch.float64, device=device)
    experts = torch.zeros((), dtype=torch.float64, device=device)
    for target in targets:
        value = per_target(target)
        if target.expert:
            experts += value
        else:
            dense += value
    if dist.is_initialized() and dist.get_world_size(stats_group) > 1:
        dist.all_reduce(dense, group=stats_group)
    if model_has_experts:
        if dist.is_initialized() and dist.get_world_size(expert_group) > 1:
            dist.all_reduce(experts, group=expert_group)
    return float((dense + experts).item())


def expert_row_groups(groups: ParallelGroups, *, sharded: bool) -> dict[bool, Any]:
    """The groups holding an expert layer's rows, keyed by ``tp_partial`` (as the direction
    context's ``row_groups``): column-parallel rows split over expert TP (= TP) and, with sharded
    masters, over expert-DP; row-parallel rows over expert-DP when sharded. The paper's row
    statistics are sums and minima, so reducing over the two groups in turn is reducing over
    their product (one tuple object, so the layers sharing it batch their collectives)."""
    column = tuple(g for g, split in ((groups.tp, groups.tp_size > 1),
                                      (groups.expert_dp, sharded)) if split)
    return {False: column or None, True: (groups.expert_dp,) if sharded else None}


def model_has_experts(targets: Sequence[SketchTarget], device: torch.device) -> bool:
    """Whether any rank holds expert targets (collective over the world, once at construction):
    under pipeline parallelism a stage may have none while the model has them."""
    flag = torch.tensor([1.0 if any(t.expert for t in targets) else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def idle_experts(targets: Sequence[SketchTarget], sketches: FlatSketchBuffer) -> list[str]:
    """Layer keys of the expert targets that received no token this step (after reduction)."""
    return [t.layer_key for t in targets
            if t.expert and sketches.received_tokens(t.layer_key) == 0]


def row_moments_of(direction: object, layer_keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """Copies of the row moments of ``layer_keys`` (none for a stateless rule such as sgd)."""
    moment = getattr(direction, "moment", None)
    if moment is None:
        return {}
    return {key: moment(key).clone() for key in layer_keys}


def hold_idle_experts_(direction: object, sketches: FlatSketchBuffer,
                       saved: dict[str, torch.Tensor], idle: Sequence[str]) -> None:
    """After the direction rule ran: idle experts' moments back to ``saved``, directions 0."""
    for key in idle:
        if key in saved:
            direction.moment(key).copy_(saved[key])
        sketches.owned_view(key).zero_()
