"""Megatron checkpoints' full tensors <-> Hugging Face tensors, by name.

The row orders of the fused tensors (``linear_qkv`` interleaved per query group, ``linear_fc1``
as ``[gate; up]``, the padded vocabulary) are :mod:`megatron_logra.hf_layout`, and the plain
renames :mod:`megatron_logra.hf_names`: both torch-only and outside ``mcore/``, shared with the
vLLM plugin. This module adds what needs the converter's :class:`HFArchitecture`: which tensors a
checkpoint has, and the checks that every tensor is used.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from megatron_logra import hf_layout as layout
from megatron_logra.hf_names import LAYER_NAME, LAYER_RENAMES
from megatron_logra.mcore.conversion.hf_config import HFArchitecture


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: HFArchitecture
) -> torch.Tensor:
    """Hugging Face's q/k/v weights (or biases) -> Megatron's per-group interleaved linear_qkv."""
    return layout.fuse_qkv(q, k, v, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim)


def split_qkv(
    qkv: torch.Tensor, arch: HFArchitecture
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    return layout.split_qkv(qkv, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
                            head_dim=arch.head_dim)


def megatron_full_tensor(
    name: str, arch: HFArchitecture, read: Callable[[str], torch.Tensor], padded_vocab: int
) -> torch.Tensor:
    """The full (TP=1) tensor of Megatron parameter ``name`` (global layer numbers), built from
    the Hugging Face tensors ``read`` returns by name."""
    if name == "embedding.word_embeddings.weight":
        return layout.pad_vocab_rows(read("model.embed_tokens.weight"), padded_vocab)
    if name == "output_layer.weight":
        # Tied models: the last pipeline stage's own copy of the embeddings.
        source = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        return layout.pad_vocab_rows(read(source), padded_vocab)
    if name == "decoder.final_layernorm.weight":
        return read("model.norm.weight")
    match = LAYER_NAME.match(name)
    if match is None:
        raise ValueError(f"Megatron parameter {name!r} has no Hugging Face counterpart")
    layer, suffix = int(match.group(1)), match.group(2)
    p = f"model.layers.{layer}."
    if suffix in LAYER_RENAMES:
        return read(p + LAYER_RENAMES[suffix])
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        return fuse_qkv(*(read(f"{p}self_attn.{proj}.{kind}")
                          for proj in ("q_proj", "k_proj", "v_proj")), arch)
    if suffix in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
        kind = suffix.rsplit(".", 1)[1]
        return layout.fuse_gate_up(read(f"{p}mlp.gate_proj.{kind}"),
                                   read(f"{p}mlp.up_proj.{kind}"))
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

    out["model.embed_tokens.weight"] = layout.strip_vocab_rows(
        take("embedding.word_embeddings.weight"), arch.vocab_size)
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = layout.strip_vocab_rows(take("output_layer.weight"),
                                                 arch.vocab_size)
    out["model.norm.weight"] = take("decoder.final_layernorm.weight")
    for i in range(arch.num_layers):
        m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        for megatron_suffix, hf_suffix in LAYER_RENAMES.items():
            if m + megatron_suffix in full:
                out[p + hf_suffix] = take(m + megatron_suffix)
        kinds = ["weight"] + (["bias"] if arch.qkv_bias else [])
        for kind in kinds:
            q, k, v = split_qkv(take(f"{m}self_attention.linear_qkv.{kind}"), arch)
            out[f"{p}self_attn.q_proj.{kind}"] = q
            out[f"{p}self_attn.k_proj.{kind}"] = k
            out[f"{p}self_attn.v_proj.{kind}"] = v
        for kind in ["weight"] + (["bias"] if arch.linear_bias else []):
            gate, up = layout.split_gate_up(take(f"{m}mlp.linear_fc1.{kind}"))
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


