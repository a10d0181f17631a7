"""Qwen3, Qwen3-MoE and Qwen2-MoE tensors <-> Megatron's: q/k norms, routed and shared experts.

What the Qwen2 / Llama layouts (:mod:`.hf_layout`) do not cover, and the entry points that add
it for every family (the converter and the weight loader call these, not :mod:`.hf_layout`
directly):

* ``self_attn.q_norm`` / ``k_norm`` (RMSNorm over one head's width) are Megatron's
  ``self_attention.q_layernorm`` / ``k_layernorm`` (``model.qk_layernorm``): renames, applied
  after the projection and before the rotary embedding on both sides;
* a Qwen3-MoE layer's ``mlp.gate`` (``[experts, hidden]``) is the router's weight
  ``mlp.router.weight``, and expert ``E``'s ``gate_proj`` / ``up_proj`` / ``down_proj`` are
  ``mlp.experts.local_experts.<E>.linear_fc1`` (``[gate; up]``, as the dense fc1) and
  ``linear_fc2``, ``E`` the expert's global index (parameters are named globally whatever the
  expert-parallel size, :mod:`megatron_logra.mcore.models.moe`);
* Qwen2-MoE's ``mlp.shared_expert.{gate,up,down}_proj`` are the shared expert's
  ``mlp.shared_experts.linear_fc1`` (``[gate; up]``) / ``linear_fc2``, and its
  ``mlp.shared_expert_gate`` (``[1, hidden]``, ``sigmoid(x w)`` scales the shared output per
  token on both sides) is ``mlp.shared_experts.gate_weight`` (``model.moe_shared_expert_gate``).

Routing: Qwen3-MoE takes a softmax over all experts' logits, keeps the top k and divides them by
their sum (``norm_topk_prob=true``); Megatron's default top-k router keeps the k largest logits
and takes a softmax over them. Softmax is monotonic, so both select the same experts, and
``exp(l_i) / sum_top-k exp(l_j)`` is both weights (checked numerically in
tests/unit/test_hf_moe.py). Qwen2-MoE's ``norm_topk_prob=false`` keeps the top k of the
softmax over all experts as they are: Megatron's ``moe_router_pre_softmax``
(``model.moe_router_pre_softmax``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping

import torch

from megatron_logra.hf_names import LAYER_NAME, LAYER_RENAMES
from megatron_logra.mcore.conversion import hf_layout
from megatron_logra.mcore.conversion.hf_config import HFArchitecture

QK_NORM_RENAMES: dict[str, str] = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
ROUTER_RENAMES: dict[str, str] = {"mlp.router.weight": "mlp.gate.weight"}
SHARED_EXPERT_RENAMES: dict[str, str] = {
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
_SHARED_FC1 = "mlp.shared_experts.linear_fc1.weight"
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


def _renames(arch: HFArchitecture) -> dict[str, str]:
    shared = arch.moe is not None and arch.moe.shared_ffn_hidden_size is not None
    return ({**(QK_NORM_RENAMES if arch.qk_norm else {}),
             **(ROUTER_RENAMES if arch.moe is not None else {}),
             **(SHARED_EXPERT_RENAMES if shared else {})})


def _has_shared(arch: HFArchitecture) -> bool:
    return arch.moe is not None and arch.moe.shared_ffn_hidden_size is not None


def megatron_full_tensor(
    name: str, arch: HFArchitecture, read: Callable[[str], torch.Tensor], padded_vocab: int
) -> torch.Tensor:
    """The full (TP=1) tensor of Megatron parameter ``name`` (global layer and expert numbers)
    from the Hugging Face tensors ``read`` returns, for every supported family."""
    match = LAYER_NAME.match(name)
    if match is not None and (arch.qk_norm or arch.moe is not None):
        p, suffix = f"model.layers.{match.group(1)}.", match.group(2)
        renames = _renames(arch)
        if suffix in renames:
            return read(p + renames[suffix])
        if suffix == _SHARED_FC1 and _has_shared(arch):
            s = f"{p}mlp.shared_expert."
            return torch.cat([read(s + "gate_proj.weight"), read(s + "up_proj.weight")])
        expert = _EXPERT.match(suffix) if arch.moe is not None else None
        if expert is not None:
            e = f"{p}mlp.experts.{expert.group(1)}."
            if expert.group(2) == "linear_fc1":
                return torch.cat([read(e + "gate_proj.weight"), read(e + "up_proj.weight")])
            return read(e + "down_proj.weight")
    return hf_layout.megatron_full_tensor(name, arch, read, padded_vocab)


def hf_tensors_from_megatron(
    full: Mapping[str, torch.Tensor], arch: HFArchitecture
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors from Megatron's full tensors by global parameter name, for every
    supported family. Every Megatron tensor must be used and every Hugging Face tensor
    produced, or ValueError."""
    if not arch.qk_norm and arch.moe is None:
        return hf_layout.hf_tensors_from_megatron(full, arch)
    renames = _renames(arch)
    out: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        match = LAYER_NAME.match(name)
        suffix = match.group(2) if match is not None else ""
        p = f"model.layers.{match.group(1)}." if match is not None else ""
        expert = _EXPERT.match(suffix) if arch.moe is not None else None
        if suffix in renames:
            out[p + renames[suffix]] = tensor
        elif suffix == _SHARED_FC1 and _has_shared(arch):
            s = f"{p}mlp.shared_expert."
            out[s + "gate_proj.weight"], out[s + "up_proj.weight"] = torch.chunk(tensor, 2)
        elif expert is not None:
            e = f"{p}mlp.experts.{expert.group(1)}."
            if expert.group(2) == "linear_fc1":
                out[e + "gate_proj.weight"], out[e + "up_proj.weight"] = torch.chunk(tensor, 2)
            else:
                out[e + "down_proj.weight"] = tensor
        else:
            rest[name] = tensor
    dense = dataclasses.replace(arch, qk_norm=False, moe=None)
    if arch.moe is None:
        out.update(hf_layout.hf_tensors_from_megatron(rest, dense))
    else:
        out.update(_moe_rest(rest, dense))
    expected = set(arch.hf_names())
    if set(out) != expected:
        raise ValueError(f"conversion produced {sorted(set(out) ^ expected)[:5]} unexpectedly; "
                         "the checkpoint and config.json describe different models")
    return {name: tensor.contiguous().clone() for name, tensor in out.items()}


def _moe_rest(rest: dict[str, torch.Tensor], dense: HFArchitecture) -> dict[str, torch.Tensor]:
    """The attention and norms of MoE layers (no dense MLP) and the embeddings, output layer
    and final norm (through :mod:`.hf_layout` with no layers)."""
    out: dict[str, torch.Tensor] = {}
    layers = {name: t for name, t in rest.items() if LAYER_NAME.match(name)}
    kinds = ["weight"] + (["bias"] if dense.qkv_bias else [])
    for i in range(dense.num_layers):
        m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        for megatron_suffix, hf_suffix in LAYER_RENAMES.items():
            if m + megatron_suffix in layers:
                out[p + hf_suffix] = layers.pop(m + megatron_suffix)
        for kind in kinds:
            qkv = layers.pop(f"{m}self_attention.linear_qkv.{kind}", None)
            if qkv is None:
                raise ValueError(f"the Megatron checkpoint has no "
                                 f"'{m}self_attention.linear_qkv.{kind}'")
            q, k, v = hf_layout.split_qkv(qkv, dense)
            out.update({f"{p}self_attn.q_proj.{kind}": q, f"{p}self_attn.k_proj.{kind}": k,
                        f"{p}self_attn.v_proj.{kind}": v})
    if layers:
        raise ValueError(f"Megatron tensors {sorted(layers)[:5]} have no place in a "
                         f"{dense.model_type} checkpoint; the checkpoint and config.json "
                         "describe different models")
    outer = {name: t for name, t in rest.items() if not LAYER_NAME.match(name)}
    out.update(hf_layout.hf_tensors_from_megatron(
        outer, dataclasses.replace(dense, num_layers=0)))
    return out
