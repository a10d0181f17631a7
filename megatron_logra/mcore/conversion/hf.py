"""Hugging Face <-> Megatron weights for the Qwen2 and Llama families.

The Megatron side is our GPTModel (``mcore/models/gpt.py``) as *full* (TP=1) tensors keyed by global
parameter name (``sharding.global_named_parameters``); sharding them for any TP/PP layout is
``sharding.shard_from_full``, exactly as the model's own initialisation does. The layouts that
differ from Hugging Face's separate projections:

* ``self_attention.linear_qkv`` fuses q, k and v *per query group*: for each of the ``g`` key/value
  heads, the ``a/g`` query heads that attend to it, then its key head, then its value head
  (``[q_0 .. q_{a/g-1}, k, v]`` per group, each head ``d`` rows). Megatron splits this tensor over
  TP along whole groups, which is why ``g`` must be divisible by the TP size. Hugging Face's
  grouped-query attention gives query head ``i`` the key/value head ``i // (a/g)``, so the
  query heads of group ``j`` are rows ``[j (a/g) d, (j+1) (a/g) d)`` of ``q_proj``. The bias (Qwen2
  always has one on q, k and v) follows the same order.
* ``mlp.linear_fc1`` stacks ``[gate; up]``: Megatron's gated linear unit applies the activation
  to the first half and multiplies by the second.
* the word embeddings are padded with zero rows to ``model.make_vocab_size_divisible_by``; the
  Hugging Face vocabulary size is kept to strip them on the way back.
* norms are RMSNorm with Hugging Face's ``rms_norm_eps`` as ``model.layernorm_epsilon``; rotary
  embeddings are the non-interleaved (``rotate_half``) kind both sides use, with ``rope_theta``
  as ``model.rotary_base``.

Everything else is a rename. Whatever cannot be represented (sliding-window attention, scaled
rotary embeddings, a head width other than hidden / heads, biases on some but not all Llama
linears) is refused with a ValueError rather than converted approximately.

A converted directory (``tools/convert_hf.py to-megatron``)::

    model/           model-only dist_checkpointing checkpoint (loads at any TP/PP layout)
    model.yaml       the derived ``model:`` section, with init_checkpoint pointing at model/
    tokenizer/       the Hugging Face tokenizer files, copied unchanged
    hf_source.json   the source config.json (and generation_config.json) and tensor dtype, so
                     that ``to-hf`` writes back the original files exactly
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_logra.config import ModelConfig
from megatron_logra.mcore.checkpointing.digest import is_model_key
from megatron_logra.mcore.models.gpt import gpt_layer_spec, padded_vocab_size
from megatron_logra.mcore.models.sharding import (
    full_shape,
    global_named_parameters,
    partition_of,
    shard_from_full,
)
from megatron_logra.mcore.process_groups import ParallelGroups

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("qwen2", "llama")
# Sequence length written into the derived config when the user does not choose one: the
# model's maximum context (32k-128k for these families) is far longer than an RL post-training
# sequence, and model.seq_length also sets the training window length.
DEFAULT_SEQ_LENGTH = 4096
CHECKPOINT_NAME = "model"
MODEL_YAML = "model.yaml"
TOKENIZER_DIR = "tokenizer"
HF_SOURCE_FILE = "hf_source.json"
HF_CONFIG_FILE = "config.json"
HF_GENERATION_CONFIG_FILE = "generation_config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
# Files of a Hugging Face tokenizer (any of them may be absent, depending on its kind).
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)
# Transformers' own shard limit for save_pretrained.
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# Derived buffers some older checkpoints store; recomputed from the config on load.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
}
_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


# ----------------------------------------------------------------------------- architecture


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
    if model_type == "qwen2":
        if getattr(config, "use_sliding_window", False):
            raise ValueError("config.json use_sliding_window=true: sliding-window attention is "
                             "not supported; convert a model with use_sliding_window=false")
        qkv_bias, linear_bias = True, False
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
    )


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
    )


def check_model_config_matches(model: ModelConfig, arch: HFArchitecture) -> None:
    """Raise ValueError unless ``model`` builds the network ``arch`` describes."""
    expected = model_config_from_hf(arch, params_dtype=model.params_dtype,
                                    seq_length=model.seq_length)
    fields = ("num_layers", "hidden_size", "num_attention_heads", "query_groups",
              "ffn_hidden_size", "normalization", "activation", "position_embedding",
              "rotary_base", "add_bias_linear", "untie_embeddings", "layernorm_epsilon")
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


# ----------------------------------------------------------------------------- fused layouts


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: HFArchitecture
) -> torch.Tensor:
    """Hugging Face's q/k/v weights (or biases) -> Megatron's per-group interleaved linear_qkv."""
    rest = q.shape[1:]
    d, groups = arch.head_dim, arch.num_kv_heads
    q = q.reshape(groups, arch.heads_per_group * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, arch: HFArchitecture
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    rest = qkv.shape[1:]
    d, groups = arch.head_dim, arch.num_kv_heads
    grouped = qkv.reshape(groups, (arch.heads_per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [arch.heads_per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    padded = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype)
    padded[: tensor.shape[0]] = tensor
    return padded


# ----------------------------------------------------------------------------- name mapping

# Megatron layer suffix -> Hugging Face layer suffix, for the plain renames.
_LAYER_RENAMES: dict[str, str] = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}


def megatron_full_tensor(
    name: str, arch: HFArchitecture, read: Callable[[str], torch.Tensor], padded_vocab: int
) -> torch.Tensor:
    """The full (TP=1) tensor of Megatron parameter ``name`` (global layer numbers), built from
    the Hugging Face tensors ``read`` returns by name."""
    if name == "embedding.word_embeddings.weight":
        return _pad_rows(read("model.embed_tokens.weight"), padded_vocab)
    if name == "output_layer.weight":
        # Tied models: the last pipeline stage's own copy of the embeddings.
        source = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        return _pad_rows(read(source), padded_vocab)
    if name == "decoder.final_layernorm.weight":
        return read("model.norm.weight")
    match = _LAYER_NAME.match(name)
    if match is None:
        raise ValueError(f"Megatron parameter {name!r} has no Hugging Face counterpart")
    layer, suffix = int(match.group(1)), match.group(2)
    p = f"model.layers.{layer}."
    if suffix in _LAYER_RENAMES:
        return read(p + _LAYER_RENAMES[suffix])
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        return fuse_qkv(*(read(f"{p}self_attn.{proj}.{kind}")
                          for proj in ("q_proj", "k_proj", "v_proj")), arch)
    if suffix in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
        kind = suffix.rsplit(".", 1)[1]
        return torch.cat([read(f"{p}mlp.gate_proj.{kind}"), read(f"{p}mlp.up_proj.{kind}")])
    raise ValueError(f"Megatron parameter {name!r} has no Hugging Face counterpart")


def hf_tensors_from_megatron(
    full: Mapping[str, torch.Tensor], arch: HFArchitecture
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors from Megatron's full tensors by global parameter name. Every
    Megatron tensor must be used and every Hugging Face tensor produced, or ValueError."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in full:
            raise ValueError(f"the Megatron checkpoint has no {name!r}")
        used.add(name)
        return full[name]

    out["model.embed_tokens.weight"] = take("embedding.word_embeddings.weight")[: arch.vocab_size]
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = take("output_layer.weight")[: arch.vocab_size]
    out["model.norm.weight"] = take("decoder.final_layernorm.weight")
    for i in range(arch.num_layers):
        m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        for megatron_suffix, hf_suffix in _LAYER_RENAMES.items():
            if m + megatron_suffix in full:
                out[p + hf_suffix] = take(m + megatron_suffix)
        kinds = ["weight"] + (["bias"] if arch.qkv_bias else [])
        for kind in kinds:
            q, k, v = split_qkv(take(f"{m}self_attention.linear_qkv.{kind}"), arch)
            out[f"{p}self_attn.q_proj.{kind}"] = q
            out[f"{p}self_attn.k_proj.{kind}"] = k
            out[f"{p}self_attn.v_proj.{kind}"] = v
        for kind in ["weight"] + (["bias"] if arch.linear_bias else []):
            gate, up = torch.chunk(take(f"{m}mlp.linear_fc1.{kind}"), 2, dim=0)
            out[f"{p}mlp.gate_proj.{kind}"] = gate
            out[f"{p}mlp.up_proj.{kind}"] = up
    unused = sorted(set(full) - used)
    if unused:
        raise ValueError(f"Megatron tensors {unused[:5]} have no place in a {arch.model_type} "
                         "checkpoint; the checkpoint and config.json describe different models")
    expected = set(arch.hf_names())
    if set(out) != expected:
        raise ValueError(f"conversion produced {sorted(set(out) ^ expected)[:5]} unexpectedly; "
                         "the checkpoint and config.json describe different models")
    # Views into the fused tensors: safetensors needs each tensor contiguous and unshared.
    return {name: tensor.contiguous().clone() for name, tensor in out.items()}


# ----------------------------------------------------------------------------- HF files


class SafetensorsReader:
    """Lazy access to a Hugging Face checkpoint's tensors (one file or an index of shards)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        index = self.directory / HF_INDEX_FILE
        single = self.directory / HF_WEIGHTS_FILE
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            with safe_open(str(single), framework="pt") as handle:
                weight_map = {name: HF_WEIGHTS_FILE for name in handle.keys()}
        else:
            raise ValueError(
                f"{self.directory} has neither {HF_WEIGHTS_FILE} nor {HF_INDEX_FILE}; point at a "
                "Hugging Face model directory with safetensors weights"
            )
        self.weight_map = weight_map

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def read(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ValueError(f"{self.directory} has no tensor {name!r}")
        with safe_open(str(self.directory / self.weight_map[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    def dtype(self) -> torch.dtype:
        """The one floating dtype all tensors share (a mixed checkpoint is refused)."""
        dtypes: set[torch.dtype] = set()
        for file in sorted(set(self.weight_map.values())):
            with safe_open(str(self.directory / file), framework="pt") as handle:
                for name in handle.keys():
                    dtypes.add(handle.get_slice(name).get_dtype())
        names = {_safetensors_dtype(d) for d in dtypes}
        if len(names) != 1:
            raise ValueError(f"{self.directory} mixes tensor dtypes {sorted(map(str, names))}; "
                             "convert a checkpoint stored in one dtype")
        return names.pop()


def _safetensors_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    if name not in table:
        raise ValueError(f"tensor dtype {name} is not float32, bfloat16 or float16")
    return table[name]


def check_hf_names(names: Iterable[str], arch: HFArchitecture) -> None:
    """Every expected tensor present, nothing unexpected (so nothing is silently dropped)."""
    present = {n for n in names if not n.endswith(_IGNORED_HF_SUFFIXES)}
    expected = set(arch.hf_names())
    missing = sorted(expected - present)
    unexpected = sorted(present - expected - set(arch.optional_hf_names()))
    if missing or unexpected:
        raise ValueError(
            f"the checkpoint's tensors do not match its {arch.model_type} config.json: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}"
        )


def check_tied_head(reader: SafetensorsReader, arch: HFArchitecture) -> None:
    """A tied model may still store lm_head.weight; it must then equal the embeddings."""
    if arch.tie_word_embeddings and "lm_head.weight" in reader.weight_map:
        if not torch.equal(reader.read("lm_head.weight"), reader.read("model.embed_tokens.weight")):
            raise ValueError("tie_word_embeddings=true but lm_head.weight differs from "
                             "model.embed_tokens.weight; the checkpoint is inconsistent")


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], directory: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Write ``tensors`` as Hugging Face does: one model.safetensors, or numbered shards of at
    most ``max_shard_bytes`` (a larger single tensor gets a shard of its own) plus an index."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be > 0")
    directory = Path(directory)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(directory / HF_WEIGHTS_FILE), metadata=metadata)
        return [HF_WEIGHTS_FILE]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for file, shard in zip(files, shards, strict=True):
        save_file(shard, str(directory / file), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / HF_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [*files, HF_INDEX_FILE]


# ----------------------------------------------------------------------------- Megatron side


@torch.no_grad()
def load_hf_weights_(
    model_chunks: Iterable[torch.nn.Module], reader: SafetensorsReader, arch: HFArchitecture,
    model: ModelConfig, groups: ParallelGroups,
) -> None:
    """Overwrite every parameter of this rank's chunks with its shard of the HF weights.

    Each rank reads only the Hugging Face tensors its own parameters need."""
    padded = padded_vocab_size(arch.vocab_size, model.make_vocab_size_divisible_by)
    for chunk in model_chunks:
        for name, param in global_named_parameters(chunk):
            full = megatron_full_tensor(name, arch, reader.read, padded)
            expected = full_shape(param, groups.tp_size)
            if tuple(full.shape) != expected:
                raise ValueError(f"{name}: Hugging Face weights give shape {tuple(full.shape)}, "
                                 f"the model built from the derived config has {expected}")
            dim, stride = partition_of(param)
            shard = shard_from_full(full, dim, stride, groups.tp_rank, groups.tp_size)
            param.copy_(shard.to(device=param.device))


def _checkpoint_to_parameter_suffix(model: ModelConfig) -> dict[str, str]:
    """Megatron's checkpoint keys rename the layer norms to Transformer Engine's fused names
    (the layer spec's sharded_state_dict_keys_map); this maps them back to parameter names."""
    spec = gpt_layer_spec(model, sequence_parallel=False, layers_per_chunk=1)
    keys_map: dict[str, str] = dict(spec.submodules.sharded_state_dict_keys_map)
    return {checkpoint: parameter for parameter, checkpoint in keys_map.items()}


def checkpoint_full_weights(
    checkpoint_dir: str | Path, model: ModelConfig
) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint (model-only or training; any layout wrote it) as a
    full tensor in its stored dtype, keyed by global parameter name. Needs a process group.

    dist_checkpointing stacks the decoder layers on a leading axis under one key
    (``decoder.layers.<suffix>``); they are unstacked into ``decoder.layers.<i>.<suffix>``.
    """
    loaded = dist_checkpointing.load_plain_tensors(str(checkpoint_dir))
    renames = _checkpoint_to_parameter_suffix(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in sorted(loaded.items()):
        if not isinstance(value, torch.Tensor) or not is_model_key(key):
            continue
        if not key.startswith("decoder.layers."):
            out[key] = value
            continue
        suffix = key[len("decoder.layers."):]
        for checkpoint_prefix, parameter_prefix in renames.items():
            if suffix.startswith(checkpoint_prefix):
                suffix = parameter_prefix + suffix[len(checkpoint_prefix):]
                break
        if value.shape[0] != model.num_layers:
            raise ValueError(f"checkpoint key {key!r} stacks {value.shape[0]} layers, the model "
                             f"has model.num_layers={model.num_layers}")
        for layer in range(model.num_layers):
            out[f"decoder.layers.{layer}.{suffix}"] = value[layer]
    return out
