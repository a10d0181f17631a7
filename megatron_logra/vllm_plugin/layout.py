"""Megatron's layouts <-> what vLLM holds: its TP shards of the targets, the Hugging Face names
its loaders take, and the reverse for the weight check.

The sync records address Megatron's full (TP=1) tensors under Megatron's names. Each worker's
shadow keeps:

* of every LoGRA target, only the Megatron TP shard its own vLLM parameter holds
  (:func:`target_tp_shard`): vLLM's TP rank t holds linear_qkv's query groups ``t g/tp ..``
  (its ``qkv_proj`` shard, stacked [q_t; k_t; v_t] instead of per group), linear_fc1's
  ``[gate_t; up_t]`` (its ``gate_up_proj`` shard) and the same input columns of the
  row-parallel linear_proj / linear_fc2 (``o_proj`` / ``down_proj``). A changed target shard is
  written into that parameter in vLLM's row order (:func:`vllm_target_shard`);
* every other tensor whole, loaded through vLLM's own ``load_weights``
  (:func:`hf_tensors`), which cuts this rank's shard itself: the word embeddings and output
  layer without Megatron's padding rows (vLLM pads its vocabulary differently), the rest renamed
  (and the fused tensors split into q/k/v and gate/up, when a whole one is loaded).

The renames and the row orders are the converter's own (:mod:`megatron_logra.hf_names`,
:mod:`megatron_logra.hf_layout`: torch-only, so they load in the vLLM venv). The reverse
direction (:func:`hf_from_vllm_shards`) reassembles what vLLM serves, so the weight check
compares vLLM's real parameters, not the shadow.

Torch only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_logra import hf_layout as layout
from megatron_logra.hf_names import LAYER_NAME, LAYER_RENAMES
from megatron_logra.sync.shard import TensorShard, megatron_tp_shard

# A LoGRA target's Megatron suffix -> its vLLM parameter and Megatron's TP slicing of it
# (partition dim, stride). vLLM's TP rank t holds the same rows (query groups t*g/tp.., and
# [gate_t; up_t]) or the same input columns (o_proj, down_proj) as Megatron's TP rank t.
_TARGETS: dict[str, tuple[str, int, int]] = {
    "self_attention.linear_qkv.weight": ("self_attn.qkv_proj.weight", 0, 1),
    "mlp.linear_fc1.weight": ("mlp.gate_up_proj.weight", 0, 2),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1, 1),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", 1, 1),
}


@dataclass(frozen=True)
class ServedArch:
    """The facts of the served model's config.json that decide the layouts."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | Any) -> ServedArch:
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        heads = get("num_attention_heads")
        head_dim = get("head_dim") or get("hidden_size") // heads
        return cls(num_heads=heads, num_kv_heads=get("num_key_value_heads") or heads,
                   head_dim=head_dim, vocab_size=get("vocab_size"),
                   tie_word_embeddings=bool(get("tie_word_embeddings", False)))


def hf_tensors(name: str, tensor: torch.Tensor, arch: ServedArch) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of Megatron's full tensor ``name`` (global layer numbers)."""
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", layout.strip_vocab_rows(tensor, arch.vocab_size))]
    if name == "output_layer.weight":
        if arch.tie_word_embeddings:
            return []  # tied: vLLM's lm_head is the embedding
        return [("lm_head.weight", layout.strip_vocab_rows(tensor, arch.vocab_size))]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", tensor)]
    match = LAYER_NAME.match(name)
    if match is None:
        raise ValueError(f"Megatron parameter {name!r} has no Hugging Face counterpart")
    prefix, suffix = f"model.layers.{match.group(1)}.", match.group(2)
    if suffix in LAYER_RENAMES:
        return [(prefix + LAYER_RENAMES[suffix], tensor)]
    kind = suffix.rsplit(".", 1)[1]
    if suffix.startswith("self_attention.linear_qkv."):
        q, k, v = layout.split_qkv(tensor, num_heads=arch.num_heads,
                                   num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim)
        return [(f"{prefix}self_attn.{proj}.{kind}", part)
                for proj, part in (("q_proj", q), ("k_proj", k), ("v_proj", v))]
    if suffix.startswith("mlp.linear_fc1."):
        gate, up = layout.split_gate_up(tensor)
        return [(f"{prefix}mlp.gate_proj.{kind}", gate), (f"{prefix}mlp.up_proj.{kind}", up)]
    raise ValueError(f"Megatron parameter {name!r} has no Hugging Face counterpart")


def _target(name: str) -> tuple[str, int, int]:
    match = LAYER_NAME.match(name)
    if match is None or match.group(2) not in _TARGETS:
        raise ValueError(f"{name!r} is not a LoGRA target vLLM shards (linear_qkv, linear_proj, "
                         "linear_fc1, linear_fc2)")
    param, dim, stride = _TARGETS[match.group(2)]
    return f"model.layers.{match.group(1)}.{param}", dim, stride


def vllm_target_param(name: str) -> str:
    """The vLLM parameter (``model.layers.N....``) that holds target ``name``'s rows."""
    return _target(name)[0]


def target_tp_shard(name: str, local_shape: Sequence[int], tp_rank: int, tp_size: int,
                    arch: ServedArch) -> TensorShard:
    """The Megatron shard of target ``name``'s full tensor that vLLM's TP rank ``tp_rank``
    holds, from the local shape of its vLLM parameter."""
    if arch.num_kv_heads % tp_size:
        raise ValueError(f"engine TP={tp_size} replicates key/value heads "
                         f"({arch.num_kv_heads}); a sharded shadow needs TP sizes that divide them")
    _, dim, stride = _target(name)
    full = list(local_shape)
    full[dim] *= tp_size
    return megatron_tp_shard(tuple(full), dim, stride, tp_rank, tp_size)


def vllm_target_shard(name: str, shard: torch.Tensor, arch: ServedArch,
                      tp_size: int) -> torch.Tensor:
    """Megatron's TP shard of target ``name`` (:func:`target_tp_shard`) in the row order of the
    vLLM parameter that holds it: linear_qkv's groups re-stacked as [q_t; k_t; v_t]; the other
    targets' shards are vLLM's as they are."""
    _, dim, _ = _target(name)
    if dim == 0 and name.endswith("self_attention.linear_qkv.weight"):
        q, k, v = layout.split_qkv(shard, num_heads=arch.num_heads // tp_size,
                                   num_kv_heads=arch.num_kv_heads // tp_size,
                                   head_dim=arch.head_dim)
        return torch.cat([q, k, v])
    return shard


def hf_from_vllm_shards(
    shards: Sequence[Mapping[str, torch.Tensor]], arch: ServedArch
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors reassembled from every vLLM TP rank's parameters (rank order)."""
    tp = len(shards)
    if arch.num_kv_heads % tp:
        raise ValueError(f"engine TP={tp} replicates key/value heads ({arch.num_kv_heads}); the "
                         "weight check supports TP sizes that divide the key/value heads")
    q_rows = arch.num_heads // tp * arch.head_dim
    kv_rows = arch.num_kv_heads // tp * arch.head_dim
    out: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        parts = [shard[name] for shard in shards]
        base, _, kind = name.rpartition(".")
        if base.endswith("self_attn.qkv_proj"):
            split = [torch.split(p, [q_rows, kv_rows, kv_rows]) for p in parts]
            stem = base.removesuffix("qkv_proj")
            for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                out[f"{stem}{proj}.{kind}"] = torch.cat([s[i] for s in split])
        elif base.endswith("mlp.gate_up_proj"):
            halves = [torch.chunk(p, 2) for p in parts]
            stem = base.removesuffix("gate_up_proj")
            out[f"{stem}gate_proj.{kind}"] = torch.cat([h[0] for h in halves])
            out[f"{stem}up_proj.{kind}"] = torch.cat([h[1] for h in halves])
        elif base.endswith(("o_proj", "down_proj")) and kind == "weight":
            out[name] = torch.cat(parts, dim=1)  # row-parallel: input columns are sharded
        elif base.endswith(("embed_tokens", "lm_head")):
            out[name] = torch.cat(parts)[: arch.vocab_size]  # vocab-parallel, padded rows cut
        else:
            out[name] = parts[0]  # replicated: norms, row-parallel biases
    return out
