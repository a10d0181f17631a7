"""Hugging Face <-> Megatron weights for the Qwen2 and Llama families: files and tensors.

The config mapping is :mod:`.hf_config` and the fused-row layouts and names :mod:`.hf_layout`.
The Megatron side is our GPTModel (``mcore/models/gpt.py``) as *full* (TP=1) tensors keyed by
global parameter name (``sharding.global_named_parameters``); sharding them for any TP/PP layout
is ``sharding.shard_from_full``, exactly as the model's own initialisation does. Norms are
RMSNorm with Hugging Face's ``rms_norm_eps`` as ``model.layernorm_epsilon``; rotary embeddings
are the non-interleaved (``rotate_half``) kind both sides use, with ``rope_theta`` as
``model.rotary_base``.

A converted directory (``tools/convert_hf.py to-megatron``)::

    model/           model-only dist_checkpointing checkpoint (loads at any TP/PP layout)
    model.yaml       the derived ``model:`` section, with init_checkpoint pointing at model/
    tokenizer/       the Hugging Face tokenizer files, copied unchanged
    hf_source.json   the source config.json (and generation_config.json) and tensor dtype, so
                     that ``to-hf`` writes back the original files exactly
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_logra.config import ModelConfig
from megatron_logra.mcore.checkpointing.digest import is_model_key
from megatron_logra.mcore.conversion.hf_config import HFArchitecture
from megatron_logra.mcore.conversion.hf_moe import megatron_full_tensor
from megatron_logra.mcore.models.gpt import gpt_layer_spec, padded_vocab_size
from megatron_logra.mcore.models.sharding import (
    full_shape,
    global_named_parameters,
    partition_of,
    shard_from_full,
)
from megatron_logra.mcore.process_groups import ParallelGroups

logger = logging.getLogger(__name__)

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
# Checkpoint key of the routed experts' stacked tensors ([layers, experts, ...]) and the
# parameter name of one expert.
_STACKED_EXPERTS = "mlp.experts.experts."
_EXPERT_PREFIX = "mlp.experts.local_experts."
# Derived buffers some older checkpoints store; recomputed from the config on load.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


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
    # Every attention kind keeps the local spec's parameter names (te_modules), so the local
    # spec's map serves all of them and a te model converts without Transformer Engine.
    local = dataclasses.replace(model, attention="local")
    spec = gpt_layer_spec(local, sequence_parallel=False, layers_per_chunk=1)
    # A block spec (MoE models: MoE and dense layers) lists its layers' specs.
    layers = getattr(spec, "layer_specs", None) or [spec]
    keys_map: dict[str, str] = {}
    for layer in layers:
        keys_map.update(layer.submodules.sharded_state_dict_keys_map)
    return {checkpoint: parameter for parameter, checkpoint in keys_map.items()}


def read_common_state(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The common (rank-independent) state a checkpoint of ours was saved with."""
    return dist_checkpointing.load_common_state_dict(str(checkpoint_dir))["common"]


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
            if suffix.startswith(_STACKED_EXPERTS):
                # Megatron stacks a layer's experts too, by global index (SequentialMLP).
                tail = suffix[len(_STACKED_EXPERTS):]
                for expert in range(value.shape[1]):
                    out[f"decoder.layers.{layer}.{_EXPERT_PREFIX}{expert}.{tail}"] = (
                        value[layer, expert])
                continue
            out[f"decoder.layers.{layer}.{suffix}"] = value[layer]
    return out
