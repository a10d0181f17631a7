"""Hugging Face Qwen2 / Llama / Qwen3 / Qwen3-MoE / Qwen2-MoE ``config.json`` <-> our ``model:``
section.

:class:`HFArchitecture` holds the facts of a config that decide the weights and the forward
pass; whatever cannot be represented (sliding-window attention, scaled rotary embeddings, a head
width other than hidden / heads, biases on some but not all Llama linears) is refused with a
ValueError rather than converted approximately.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megatron_logra.config import ModelConfig

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("qwen2", "llama", "qwen3", "qwen3_moe", "qwen2_moe")
QK_NORM_MODEL_TYPES: tuple[str, ...] = ("qwen3", "qwen3_moe")
"""Families with per-head q/k RMSNorms (``model.qk_layernorm``); their tensors, and the experts
of the MoE families, are mapped by :mod:`.hf_moe`."""
MOE_MODEL_TYPES: tuple[str, ...] = ("qwen3_moe", "qwen2_moe")
# Sequence length written into the derived config when the user does not choose one: the
# model's maximum context (32k-128k for these families) is far longer than an RL post-training
# sequence, and model.seq_length also sets the training window length.
DEFAULT_SEQ_LENGTH = 4096
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
}


# ----------------------------------------------------------------------------- architecture


@dataclass(frozen=True, kw_only=True)
class HFExperts:
    """An MoE layer's routed experts: ``num_experts`` SwiGLU MLPs of width ``ffn_hidden_size``,
    ``topk`` per token; with ``shared_ffn_hidden_size`` a shared expert every token passes,
    scaled by a sigmoid gate (Qwen2-MoE)."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    pre_softmax: bool
    """``norm_topk_prob=false``: the top k of a softmax over all experts, not renormalised."""
    shared_ffn_hidden_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class HFArchitecture:
    """The facts of a Qwen2 / Llama config that decide the weights and the forward pass."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    """Rows of Hugging Face's embedding (often more than the tokenizer's vocabulary)."""
    tie_word_embeddings: bool
    qkv_bias: bool
    """Biases on q, k and v (Qwen2 always; Llama with attention_bias)."""
    linear_bias: bool
    """Biases on o_proj and the MLP too (Llama with attention_bias and mlp_bias)."""
    rotary_base: int
    norm_eps: float
    max_position_embeddings: int
    qk_norm: bool = False
    """Per-head q_norm / k_norm (Qwen3)."""
    moe: HFExperts | None = None
    """Every decoder layer's MLP is a routed mixture of experts (Qwen3-MoE); None: dense."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def hf_names(self) -> list[str]:
        """Every tensor a Hugging Face checkpoint of this architecture holds (tied models may
        also carry an ``lm_head.weight`` equal to the embeddings; see ``optional_hf_names``)."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                names.append(f"{p}self_attn.{proj}.weight")
            if self.qkv_bias:
                names += [f"{p}self_attn.{proj}.bias" for proj in ("q_proj", "k_proj", "v_proj")]
            if self.linear_bias:
                names.append(f"{p}self_attn.o_proj.bias")
            if self.qk_norm:
                names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
            if self.moe is not None:
                names.append(f"{p}mlp.gate.weight")
                names += [f"{p}mlp.experts.{e}.{proj}.weight" for e in range(self.moe.num_experts)
                          for proj in ("gate_proj", "up_proj", "down_proj")]
                if self.moe.shared_ffn_hidden_size is not None:
                    names += [f"{p}mlp.shared_expert.{proj}.weight"
                              for proj in ("gate_proj", "up_proj", "down_proj")]
                    names.append(f"{p}mlp.shared_expert_gate.weight")
                continue
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names.append(f"{p}mlp.{proj}.weight")
                if self.linear_bias:
                    names.append(f"{p}mlp.{proj}.bias")
        return names

    def optional_hf_names(self) -> list[str]:
        return ["lm_head.weight"] if self.tie_word_embeddings else []


def _field(config: Any, name: str) -> Any:
    value = getattr(config, name, None)
    if value is None:
        raise ValueError(f"config.json has no {name!r}; it is needed to convert the model")
    return value


def _rope_theta(config: Any) -> int:
    """``rope_theta`` of unscaled rotary embeddings (the only kind our model builds)."""
    # Transformers >= 5 gathers rotary settings into rope_parameters (converting the older
    # top-level rope_theta / rope_scaling fields when it reads a config).
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    scaling = getattr(config, "rope_scaling", None)
    if rope_type != "default" or (scaling and scaling.get("rope_type", "default") != "default"):
        raise ValueError(
            f"config.json asks for {rope_type!r} rotary scaling ({params or scaling}); only "
            "unscaled rotary embeddings (rope_type 'default') are supported"
        )
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("config.json has no rope_theta; it is needed to convert the model")
    if float(theta) != int(theta):
        raise ValueError(f"config.json rope_theta={theta} is not an integer; model.rotary_base is")
    return int(theta)


def architecture_from_hf_config(config_dict: Mapping[str, Any]) -> HFArchitecture:
    """Read (and check we can represent) a Qwen2 or Llama ``config.json``."""
    from transformers import AutoConfig

    model_type = config_dict.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json model_type={model_type!r} is not supported; convert one of "
            f"{list(SUPPORTED_MODEL_TYPES)}"
        )
    fields = {k: v for k, v in config_dict.items() if k != "model_type"}
    # Transformers' config class applies the family's defaults and its own legacy conversions.
    config = AutoConfig.for_model(model_type, **fields)
    hidden = int(_field(config, "hidden_size"))
    heads = int(_field(config, "num_attention_heads"))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if hidden % heads:
        raise ValueError(f"config.json hidden_size={hidden} is not divisible by "
                         f"num_attention_heads={heads}")
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and int(head_dim) != hidden // heads:
        raise ValueError(
            f"config.json head_dim={head_dim} differs from hidden_size / num_attention_heads = "
            f"{hidden // heads}; our ModelConfig has no separate head width (kv_channels)"
        )
    if heads % kv_heads:
        raise ValueError(f"config.json num_attention_heads={heads} is not divisible by "
                         f"num_key_value_heads={kv_heads}")
    if _field(config, "hidden_act") != "silu":
        raise ValueError(f"config.json hidden_act={config.hidden_act!r}: only 'silu' (SwiGLU) is "
                         "supported")
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        if getattr(config, "use_sliding_window", False):
            raise ValueError("config.json use_sliding_window=true: sliding-window attention is "
                             "not supported; convert a model with use_sliding_window=false")
        # Qwen2 always has q/k/v biases, Qwen2-MoE its qkv_bias (true by default); Qwen3 has
        # attention_bias (false in its releases).
        if model_type == "qwen2_moe":
            qkv_bias = bool(getattr(config, "qkv_bias", True))
        else:
            qkv_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        linear_bias = False
    else:
        attention_bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        if attention_bias != mlp_bias:
            raise ValueError(
                f"config.json attention_bias={attention_bias} with mlp_bias={mlp_bias}: "
                "Megatron's add_bias_linear puts biases on all four linears or none"
            )
        qkv_bias = linear_bias = attention_bias
    return HFArchitecture(
        model_type=model_type,
        num_layers=int(_field(config, "num_hidden_layers")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        ffn_hidden_size=int(_field(config, "intermediate_size")),
        vocab_size=int(_field(config, "vocab_size")),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        linear_bias=linear_bias,
        rotary_base=_rope_theta(config),
        norm_eps=float(_field(config, "rms_norm_eps")),
        max_position_embeddings=int(_field(config, "max_position_embeddings")),
        qk_norm=model_type in QK_NORM_MODEL_TYPES,
        moe=_experts(config) if model_type in MOE_MODEL_TYPES else None,
    )


def _experts(config: Any) -> HFExperts:
    """The routed experts of a Qwen3-MoE / Qwen2-MoE config, refusing what Megatron's MoE layer
    would not reproduce."""
    if getattr(config, "mlp_only_layers", None):
        raise ValueError(f"config.json mlp_only_layers={config.mlp_only_layers}: dense layers "
                         "among the MoE ones are not converted; convert a model whose every "
                         "layer is MoE")
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    if step != 1:
        # Hugging Face makes layers step-1, 2 step-1, ... MoE; Megatron's moe_layer_freq makes
        # layers 0, step, ... MoE: only step 1 is the same set of layers.
        raise ValueError(f"config.json decoder_sparse_step={step}: only 1 (every layer MoE) "
                         "maps onto model.moe_layer_freq")
    shared = getattr(config, "shared_expert_intermediate_size", None)
    return HFExperts(num_experts=int(_field(config, "num_experts")),
                     topk=int(_field(config, "num_experts_per_tok")),
                     ffn_hidden_size=int(_field(config, "moe_intermediate_size")),
                     # Renormalised top-k of a softmax == softmax over the top-k logits
                     # (Megatron's default); without renormalisation: its pre-softmax router.
                     pre_softmax=not bool(getattr(config, "norm_topk_prob", False)),
                     shared_ffn_hidden_size=int(shared) if shared else None)


def params_dtype_for(hf_dtype: torch.dtype) -> str:
    """The Megatron params_dtype that holds Hugging Face tensors of ``hf_dtype`` exactly."""
    if hf_dtype == torch.bfloat16:
        return "bf16"
    if hf_dtype in (torch.float32, torch.float16):
        # fp16 has no Megatron params_dtype here; fp32 holds every fp16 value exactly.
        return "fp32"
    raise ValueError(f"Hugging Face tensors of dtype {hf_dtype} cannot be converted")


def model_config_from_hf(
    arch: HFArchitecture, *, params_dtype: str, seq_length: int | None = None
) -> ModelConfig:
    """The ModelConfig that builds our GPTModel with the same forward pass."""
    return ModelConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=None if arch.num_kv_heads == arch.num_heads else arch.num_kv_heads,
        ffn_hidden_size=arch.ffn_hidden_size,
        seq_length=seq_length or min(arch.max_position_embeddings, DEFAULT_SEQ_LENGTH),
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding="rope",
        rotary_base=arch.rotary_base,
        add_bias_linear=arch.linear_bias,
        # Megatron's add_qkv_bias adds q/k/v biases where add_bias_linear adds none.
        add_qkv_bias=arch.qkv_bias and not arch.linear_bias,
        untie_embeddings=not arch.tie_word_embeddings,
        layernorm_epsilon=arch.norm_eps,
        params_dtype=params_dtype,
        qk_layernorm=arch.qk_norm,
        **_moe_model_fields(arch),
    )


def _moe_model_fields(arch: HFArchitecture) -> dict[str, Any]:
    if arch.moe is None:
        return {}
    shared = arch.moe.shared_ffn_hidden_size
    return {"num_moe_experts": arch.moe.num_experts, "moe_router_topk": arch.moe.topk,
            "moe_ffn_hidden_size": arch.moe.ffn_hidden_size,
            "moe_router_pre_softmax": arch.moe.pre_softmax,
            "moe_shared_expert_ffn_hidden_size": shared,
            "moe_shared_expert_gate": shared is not None}


def check_model_config_matches(model: ModelConfig, arch: HFArchitecture) -> None:
    """Raise ValueError unless ``model`` builds the network ``arch`` describes."""
    expected = model_config_from_hf(arch, params_dtype=model.params_dtype,
                                    seq_length=model.seq_length)
    fields = ("num_layers", "hidden_size", "num_attention_heads", "query_groups",
              "ffn_hidden_size", "normalization", "activation", "position_embedding",
              "rotary_base", "add_bias_linear", "untie_embeddings", "layernorm_epsilon",
              "qk_layernorm", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
              "moe_shared_expert_ffn_hidden_size", "moe_layer_freq", "moe_router_pre_softmax",
              "moe_shared_expert_gate")
    mismatched = [f"model.{name}: checkpoint {getattr(model, name)!r} vs config.json "
                  f"{getattr(expected, name)!r}"
                  for name in fields if getattr(model, name) != getattr(expected, name)]
    # add_qkv_bias is moot when add_bias_linear already puts biases on q/k/v.
    if (model.add_qkv_bias or model.add_bias_linear) != arch.qkv_bias:
        mismatched.append(f"q/k/v biases: checkpoint {model.add_qkv_bias or model.add_bias_linear}"
                          f" vs config.json {arch.qkv_bias}")
    if mismatched:
        raise ValueError("the Megatron checkpoint and the Hugging Face config.json describe "
                         f"different models ({'; '.join(mismatched)}); pass the config.json the "
                         "checkpoint was converted from")


def hf_config_from_model_config(
    model: ModelConfig, *, vocab_size: int, dtype: torch.dtype
) -> dict[str, Any]:
    """A config.json for a checkpoint that has no Hugging Face source (trained from scratch):
    Qwen2 when only q/k/v carry biases, Llama otherwise."""
    if model.qk_layernorm or model.num_moe_experts is not None:
        raise ValueError("a model with model.qk_layernorm or experts has no derived config.json "
                         "(only Qwen2 / Llama are derived); pass the Qwen3 / Qwen3-MoE "
                         "config.json it was converted from (to-hf --hf-config)")
    from transformers import LlamaConfig, Qwen2Config

    unsupported = {
        "normalization": (model.normalization, "RMSNorm"),
        "activation": (model.activation, "swiglu"),
        "position_embedding": (model.position_embedding, "rope"),
    }
    for name, (value, needed) in unsupported.items():
        if value != needed:
            raise ValueError(f"model.{name}={value!r} has no Qwen2/Llama equivalent (needs "
                             f"{needed!r})")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.query_groups,
        hidden_act="silu",
        max_position_embeddings=model.seq_length,
        rms_norm_eps=model.layernorm_epsilon,
        tie_word_embeddings=not model.untie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(model.rotary_base)},
        dtype=_DTYPE_NAMES[dtype],
    )
    if model.add_qkv_bias and not model.add_bias_linear:
        config = Qwen2Config(**common, use_sliding_window=False,
                             architectures=["Qwen2ForCausalLM"])
    else:
        config = LlamaConfig(**common, attention_bias=model.add_bias_linear,
                             mlp_bias=model.add_bias_linear, head_dim=model.hidden_size
                             // model.num_attention_heads, architectures=["LlamaForCausalLM"])
    return config.to_diff_dict()


