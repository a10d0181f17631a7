"""Hugging Face (Qwen2 / Llama / Qwen3 / Qwen3-MoE, safetensors) <-> Megatron checkpoints: the
config mapping (:mod:`.hf_config`), the fused-row layouts (:mod:`.hf_layout`), the q/k norms and
experts (:mod:`.hf_moe`, whose tensor mappings are the entry points for every family) and the
files and weights (:mod:`.hf`). ``tools/convert_hf.py`` is the command line."""

from megatron_logra.mcore.conversion.hf import (
    CHECKPOINT_NAME,
    DEFAULT_MAX_SHARD_BYTES,
    HF_CONFIG_FILE,
    HF_GENERATION_CONFIG_FILE,
    HF_INDEX_FILE,
    HF_SOURCE_FILE,
    HF_WEIGHTS_FILE,
    MODEL_YAML,
    TOKENIZER_DIR,
    TOKENIZER_FILES,
    SafetensorsReader,
    check_hf_names,
    check_tied_head,
    checkpoint_full_weights,
    load_hf_weights_,
    read_common_state,
    write_safetensors,
)
from megatron_logra.mcore.conversion.hf_config import (
    DEFAULT_SEQ_LENGTH,
    SUPPORTED_MODEL_TYPES,
    HFArchitecture,
    architecture_from_hf_config,
    check_model_config_matches,
    hf_config_from_model_config,
    model_config_from_hf,
    params_dtype_for,
)
from megatron_logra.mcore.conversion.hf_layout import fuse_qkv, split_qkv
from megatron_logra.mcore.conversion.hf_moe import (
    hf_tensors_from_megatron,
    megatron_full_tensor,
)

__all__ = [
    "CHECKPOINT_NAME", "DEFAULT_MAX_SHARD_BYTES", "DEFAULT_SEQ_LENGTH", "HF_CONFIG_FILE",
    "HF_GENERATION_CONFIG_FILE", "HF_INDEX_FILE", "HF_SOURCE_FILE", "HF_WEIGHTS_FILE",
    "MODEL_YAML", "SUPPORTED_MODEL_TYPES", "TOKENIZER_DIR", "TOKENIZER_FILES", "HFArchitecture",
    "SafetensorsReader", "architecture_from_hf_config", "check_hf_names",
    "check_model_config_matches", "check_tied_head", "checkpoint_full_weights", "fuse_qkv",
    "hf_config_from_model_config", "hf_tensors_from_megatron", "load_hf_weights_",
    "megatron_full_tensor", "model_config_from_hf", "params_dtype_for", "read_common_state",
    "split_qkv", "write_safetensors",
]
