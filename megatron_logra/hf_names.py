"""Megatron's parameter names <-> the Hugging Face (Llama / Qwen2) names they map to by a plain
rename. Torch-free and outside ``mcore/``: the converter (``mcore/conversion/hf_layout.py``) and
the vLLM plugin's layouts (which run without Megatron) read the same table."""

from __future__ import annotations

import re

LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
"""A decoder layer's parameter: group 1 its global layer number, group 2 its suffix."""

LAYER_RENAMES: dict[str, str] = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}
"""Megatron layer suffix -> Hugging Face layer suffix (under ``model.layers.N.``); the fused
``linear_qkv`` and ``linear_fc1`` split into several tensors and are not renames."""
