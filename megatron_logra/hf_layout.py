"""Megatron's fused row orders <-> Hugging Face's separate projections: tensors and sizes only.

* ``self_attention.linear_qkv`` fuses q, k and v *per query group*: for each of the ``g`` key/value
  heads, the ``a/g`` query heads that attend to it, then its key head, then its value head
  (``[q_0 .. q_{a/g-1}, k, v]`` per group, each head ``d`` rows). Megatron splits this tensor over
  TP along whole groups, which is why ``g`` must be divisible by the TP size. Hugging Face's
  grouped-query attention gives query head ``i`` the key/value head ``i // (a/g)``, so the
  query heads of group ``j`` are rows ``[j (a/g) d, (j+1) (a/g) d)`` of ``q_proj``. The bias (Qwen2
  always has one on q, k and v) follows the same order.
* ``mlp.linear_fc1`` stacks ``[gate; up]``: Megatron's gated linear unit applies the activation
  to the first half and multiplies by the second.
* the word embeddings (and an untied output layer) are padded with zero rows to
  ``model.make_vocab_size_divisible_by``; the Hugging Face vocabulary size strips them again.

Torch only and outside ``mcore/``: the converter (``mcore/conversion/hf_layout.py``) and the vLLM
plugin (which runs without Megatron) use these same functions, so the two cannot disagree.
"""

from __future__ import annotations

import torch


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_kv_heads: int,
             head_dim: int) -> torch.Tensor:
    """Hugging Face's q/k/v weights (or biases) -> Megatron's per-group interleaved linear_qkv."""
    rest = q.shape[1:]
    q = q.reshape(num_kv_heads, -1, *rest)
    k = k.reshape(num_kv_heads, head_dim, *rest)
    v = v.reshape(num_kv_heads, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, *, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: views of ``qkv`` as Hugging Face's q, k and v."""
    rest = qkv.shape[1:]
    q_rows = num_heads // num_kv_heads * head_dim
    grouped = qkv.reshape(num_kv_heads, q_rows + 2 * head_dim, *rest)
    q, k, v = torch.split(grouped, [q_rows, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Hugging Face's gate and up projections -> Megatron's linear_fc1 ``[gate; up]``."""
    return torch.cat([gate, up])


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_gate_up`: views of ``fc1`` as (gate, up)."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate, up


def pad_vocab_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows`` (Megatron's padded vocabulary)."""
    if tensor.shape[0] > rows:
        raise ValueError(f"{tensor.shape[0]} vocabulary rows do not fit a padded vocabulary of "
                         f"{rows}")
    if tensor.shape[0] == rows:
        return tensor
    padded = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype)
    padded[: tensor.shape[0]] = tensor
    return padded


def strip_vocab_rows(tensor: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Inverse of :func:`pad_vocab_rows`: the first ``vocab_size`` rows (a view)."""
    return tensor[:vocab_size]
