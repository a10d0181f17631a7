"""Mixture-of-experts layers: Megatron's ``MoELayer`` with sketch-capable ``SequentialMLP`` experts.

An MoE decoder layer is Megatron's own: its top-k router, its token dispatcher (``alltoall`` or
``allgather`` over the expert-parallel group) and ``SequentialMLP`` experts -- a list of
Megatron MLPs whose ``linear_fc1`` / ``linear_fc2`` are our sketch-capable parallel linears, so
each expert gets its own projection and sketch and never a dense weight gradient. An optional
shared expert (``SharedExpertMLP``, every token) is a dense MLP over the same linears and is
sketched like one. The router's weight (``[experts, hidden]``, fp32) is not a target: it is
trained by the native optimizer in library mode (docs/moe.md says why).

Names. Megatron numbers an EP rank's experts locally (``local_experts.0`` ..); a parameter's
*global* name uses the expert's global index (``ep_rank * local + i``), so initialisation, layer
keys and full weights are the same for every expert-parallel size.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_logra.config import ModelConfig
from megatron_logra.config.moe import expert_ffn_width
from megatron_logra.mcore.compat.moe_fixes import apply_moe_fixes
from megatron_logra.mcore.tensor_parallel.sketched_linear import (
    SketchedColumnParallelLinear,
    SketchedRowParallelLinear,
)

_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def moe_transformer_kwargs(m: ModelConfig, ep: int) -> dict[str, Any]:
    """The MoE part of Megatron's TransformerConfig (empty for a dense model)."""
    if m.num_moe_experts is None:
        return {}
    return {
        "num_moe_experts": m.num_moe_experts,
        "moe_router_topk": m.moe_router_topk,
        "moe_ffn_hidden_size": expert_ffn_width(m),
        "moe_shared_expert_intermediate_size": m.moe_shared_expert_ffn_hidden_size,
        "moe_token_dispatcher_type": m.moe_token_dispatcher,
        "moe_layer_freq": m.moe_layer_freq,
        "moe_router_pre_softmax": m.moe_router_pre_softmax,
        "moe_shared_expert_gate": m.moe_shared_expert_gate,
        "expert_model_parallel_size": ep,
        # Dropless routing, no auxiliary loss: the loss is the policy's alone, and every routed
        # token reaches its expert (what the identity limit compares against).
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_expert_capacity_factor": None,
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
    }


def moe_mlp_spec() -> ModuleSpec:
    """Megatron's local MoE spec (``SequentialMLP`` experts) with sketch-capable linears in the
    routed experts and the shared expert."""
    apply_moe_fixes()
    spec = copy.deepcopy(get_moe_module_spec(use_te=False, num_experts=2, moe_grouped_gemm=False))
    if spec.submodules.experts.module is not SequentialMLP:
        raise RuntimeError(
            f"Megatron's local MoE spec builds {spec.submodules.experts.module.__name__} experts, "
            "not SequentialMLP: the sketched experts need an update for this megatron-core"
        )
    for part in (spec.submodules.experts, spec.submodules.shared_experts):
        old = part.submodules
        part.submodules = MLPSubmodules(
            linear_fc1=SketchedColumnParallelLinear, linear_fc2=SketchedRowParallelLinear,
            activation_func=getattr(old, "activation_func", None),
        )
    return spec


def expert_index_offset(module: torch.nn.Module) -> int:
    """Global index of a ``SequentialMLP``'s first local expert."""
    if not isinstance(module, SequentialMLP):
        raise TypeError(f"expected SequentialMLP experts, got {type(module).__name__}")
    return module.ep_group.rank() * module.num_local_experts


def expert_offsets(model: torch.nn.Module) -> dict[str, int]:
    """``{module prefix of local_experts.: global offset}`` for every MoE layer of ``model``."""
    return {
        f"{name}.local_experts.": expert_index_offset(module)
        for name, module in model.named_modules()
        if isinstance(module, SequentialMLP)
    }


def global_expert_name(name: str, offsets: dict[str, int]) -> str:
    """``...experts.local_experts.<i>...`` with the local index made global (other names as
    they are)."""
    match = _LOCAL_EXPERT.match(name)
    if match is None:
        return name
    head, index, tail = match.groups()
    return f"{head}{offsets.get(head, 0) + int(index)}{tail}"


def is_expert_name(name: str) -> bool:
    """Whether a (global) parameter name belongs to a routed expert (split over EP)."""
    return _LOCAL_EXPERT.match(name) is not None


def moe_layers(layer: torch.nn.Module) -> MoELayer | None:
    mlp = getattr(layer, "mlp", None)
    return mlp if isinstance(mlp, MoELayer) else None
