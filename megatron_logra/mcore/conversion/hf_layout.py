"""Megatron's fused layouts <-> Hugging Face's separate projections, and the name mapping.

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

Everything else is a rename. Pure tensor code: a rollout engine's weight sync uses the same row
orders.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from megatron_logra.hf_names import LAYER_NAME, LAYER_RENAMES
from megatron_logra.mcore.conversion.hf_config import HFArchitecture

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


