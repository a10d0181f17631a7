"""Mixture-of-experts settings: what an MoE GPT is, and which combinations are refused (and why).

The keys live in the ``model`` section (``model.num_moe_experts`` and the ``moe_*`` keys) and
``parallel.ep``; this module checks them, the model section alone (:func:`check_moe_model`) and
against the other sections (:func:`check_moe_run`). docs/moe.md has the design.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron_logra.config.checks import check_choice, check_positive

if TYPE_CHECKING:  # the model section imports this module
    from megatron_logra.config.model import ModelConfig

TOKEN_DISPATCHERS: tuple[str, ...] = ("alltoall", "allgather")
# Defaults of the keys that only act with experts (a non-default value without experts is
# refused: it would be accepted and do nothing).
_MOE_ONLY_DEFAULTS: dict[str, Any] = {
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": None,
    "moe_shared_expert_ffn_hidden_size": None,
    "moe_layer_freq": 1,
    "moe_router_pre_softmax": False,
    "moe_shared_expert_gate": False,
    "moe_token_dispatcher": "alltoall",
}


def is_moe_layer(m: ModelConfig, global_index: int) -> bool:
    """Whether decoder layer ``global_index`` (0-based) has routed experts."""
    return m.num_moe_experts is not None and global_index % m.moe_layer_freq == 0


def expert_ffn_width(m: ModelConfig) -> int:
    return m.moe_ffn_hidden_size or m.ffn_hidden_size


def check_moe_model(m: ModelConfig, path: str = "model") -> None:
    if m.num_moe_experts is None:
        for name, default in _MOE_ONLY_DEFAULTS.items():
            if getattr(m, name) != default:
                raise ValueError(
                    f"{path}.{name}={getattr(m, name)!r} only acts in an MoE model; set "
                    f"{path}.num_moe_experts or drop {path}.{name}"
                )
        return
    check_positive(f"{path}.num_moe_experts", m.num_moe_experts)
    check_positive(f"{path}.moe_router_topk", m.moe_router_topk)
    check_positive(f"{path}.moe_layer_freq", m.moe_layer_freq)
    check_choice(f"{path}.moe_token_dispatcher", m.moe_token_dispatcher, TOKEN_DISPATCHERS)
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_ffn_hidden_size"):
        if getattr(m, name) is not None:
            check_positive(f"{path}.{name}", getattr(m, name))
    if m.moe_shared_expert_gate and m.moe_shared_expert_ffn_hidden_size is None:
        raise ValueError(
            f"{path}.moe_shared_expert_gate=true gates a shared expert, but there is none; set "
            f"{path}.moe_shared_expert_ffn_hidden_size or drop the gate"
        )
    if m.num_moe_experts < 2:
        raise ValueError(
            f"{path}.num_moe_experts={m.num_moe_experts}: a router needs at least 2 experts; "
            f"use a dense model ({path}.num_moe_experts unset) or raise it"
        )
    if m.moe_router_topk > m.num_moe_experts:
        raise ValueError(
            f"{path}.moe_router_topk={m.moe_router_topk} exceeds {path}.num_moe_experts="
            f"{m.num_moe_experts}; a token cannot go to more experts than there are"
        )


def check_moe_run(cfg: Any) -> None:
    """The MoE settings against the layout and the optimizer (``cfg``: a root Config)."""
    m, p, o = cfg.model, cfg.parallel, cfg.optimizer
    if m.num_moe_experts is None:
        if p.ep != 1:
            raise ValueError(
                f"parallel.ep={p.ep} splits experts, but the model has none; set "
                "model.num_moe_experts or parallel.ep=1"
            )
        return
    if m.num_moe_experts % p.ep:
        raise ValueError(
            f"parallel.ep={p.ep} must divide model.num_moe_experts={m.num_moe_experts} (every "
            "expert-parallel rank holds the same number of experts); change one of them"
        )
    if p.dp is not None and p.dp % p.ep:
        raise ValueError(
            f"parallel.ep={p.ep} must divide the data-parallel size {p.dp} (expert-parallel "
            "ranks are carved out of the data-parallel ones); change the world size or "
            "parallel.ep"
        )
    if p.tp > 1 and not p.sp:
        raise ValueError(
            f"an MoE model at parallel.tp={p.tp} needs parallel.sp=true: Megatron's MoE layer "
            "refuses tensor parallelism without sequence parallelism in training"
        )
    if p.tp > 1 and m.add_bias_linear:
        raise ValueError(
            f"an MoE model at parallel.tp={p.tp} needs model.add_bias_linear=false: Megatron "
            "supports expert biases only with expert tensor parallelism 1"
        )
    if o.name == "lora":
        raise ValueError(
            "optimizer.name=lora does not adapt experts (its targets are dense linears); use "
            "optimizer.name=logra or a dense optimizer with an MoE model"
        )
    if cfg.rollout.separate:
        # Refused rather than half-built: policy sync assembles full weights over the tensor-
        # and pipeline-parallel groups only (experts live on their expert-parallel ranks), the
        # engine's shadow names only dense targets, the Megatron engine runs one data-parallel
        # rank (no expert parallelism, and MoE at engine TP > 1 needs sequence parallelism it
        # does not have) and the vLLM plugin has no layout for fused experts.
        raise ValueError(
            f"model.num_moe_experts={m.num_moe_experts} with rollout.placement=separate: policy "
            "sync does not carry expert weights to a separate engine (neither rollout.engine="
            "megatron nor vllm); use rollout.placement=colocated for an MoE model"
        )
