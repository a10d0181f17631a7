"""Narrow fixes for Megatron-Core 0.16 bugs on paths this package uses (applied explicitly).

1. Loading a distributed optimizer with torch's Adam.

``DistributedOptimizer`` + torch's Adam (no Transformer Engine or apex) cannot load a
``fully_reshardable`` checkpoint: torch Adam keeps a per-parameter ``step`` tensor in its state,
``load_parameter_state_from_fully_reshardable`` leaves ``step`` out of the tensors it loads (the
step is restored from the param groups instead), and ``_set_main_param_and_optimizer_states``
then copies every key of the *destination* state, ``step`` included, and fails with
``KeyError: 'step'``. With Transformer Engine's FusedAdam the step lives in the param groups and
the bug does not arise. The fix copies only the keys the loader provides and leaves ``step``
(already set from the param groups) alone; any other missing key still raises.

2. A shared Adam step after loading. ``DistributedOptimizer.load_state_dict`` gives every
parameter's torch Adam state *the same* ``step`` tensor; torch's Adam increments each parameter's
step in place, so the shared counter advances once per parameter per step and the bias
correction of every later step is wrong (a resumed run silently diverges from an uninterrupted
one). :func:`untie_adam_steps` gives each parameter its own copy.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

_original_set_states = DistributedOptimizer._set_main_param_and_optimizer_states
_applied = False


def _set_main_param_and_optimizer_states(
    self: DistributedOptimizer, model_param: torch.nn.Parameter, tensors: dict[str, Any]
) -> None:
    if "step" in tensors or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        _original_set_states(self, model_param, tensors)
        return
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    destination = {"param": main_param, **self.optimizer.state[main_param]}
    for key, target in destination.items():
        if key == "step":
            continue
        if key not in tensors:
            raise KeyError(f"checkpoint provides no optimizer state {key!r} for a parameter")
        target.copy_(tensors[key])


def apply_megatron_fixes() -> None:
    """Install the fixes above (idempotent)."""
    global _applied
    if not _applied:
        DistributedOptimizer._set_main_param_and_optimizer_states = (
            _set_main_param_and_optimizer_states
        )
        _applied = True


def untie_adam_steps(optimizer: Any) -> int:
    """Give every parameter of every torch optimizer inside ``optimizer`` its own ``step``
    tensor; returns how many were shared. Call after loading optimizer state."""
    inner_optimizers = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            inner_optimizers.append(inner)
    untied = 0
    for inner in inner_optimizers:
        seen: set[int] = set()
        for state in inner.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.clone()
                    untied += 1
                seen.add(id(state["step"]))
    return untied
