"""Megatron's layouts <-> the Hugging Face names vLLM loads, and vLLM's TP shards <-> HF tensors.

The engine's shadow holds Megatron's full (TP=1) tensors under Megatron's names (what the sync
records address). vLLM's ``load_weights`` takes Hugging Face tensors and does the rest itself:
it stacks q/k/v into ``qkv_proj`` as [q; k; v] and gate/up into ``gate_up_proj``, and cuts each
TP rank's shard (its query heads and their key/value heads; column slices for the row-parallel
``o_proj`` / ``down_proj``). So a sync writes, per changed Megatron tensor:

* ``linear_qkv`` (rows interleaved per query group: the group's query heads, then its key head,
  then its value head) -> ``q_proj``, ``k_proj``, ``v_proj``;
* ``linear_fc1`` ([gate; up]) -> ``gate_proj``, ``up_proj``;
* the word embeddings and output layer without Megatron's padding rows; everything else renamed.

The renames and the row orders are the converter's own (:mod:`megatron_logra.hf_names`,
:mod:`megatron_logra.hf_layout`: torch-only, so they load in the vLLM venv). The reverse direction (:func:`hf_from_vllm_shards`) reassembles what vLLM
serves, so the weight check compares vLLM's real parameters, not the shadow.

Torch only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_logra import hf_layout as layout
from megatron_logra.hf_names import LAYER_NAME, LAYER_RENAMES


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
