"""``scaled_dot_product_attention`` that also carries forward-mode tangents.

PyTorch's fused SDPA kernels have no forward-AD formula: a dual input reaching
``_scaled_dot_product_flash_attention_for_cpu`` (torch 2.13) raises ``NotImplementedError``, and
the KL probe pushes a tangent through every layer's core attention. :func:`attention` calls the
fused kernel directly when no input carries a tangent (training, sampling: its own backward, no
change at all), and otherwise goes through :class:`_AttentionWithTangent`, whose primal output is
the same fused kernel's (so the probe's primal logits are those of a plain forward) and whose
``jvp`` is the exact derivative of softmax attention written out:

    S = scale * Q K^T (masked),  P = softmax(S),  O = P V
    dS = scale * (dQ K^T + Q dK^T)
    dO = (P * (dS - rowsum(P * dS))) V + P dV

The rule forms ``P`` for a block of query rows at a time (``QUERY_BLOCK`` rows), so the probe's
temporary is ``[b, heads, QUERY_BLOCK, s_k]`` per layer, not ``s x s``; nothing is kept after the
layer (the probe runs under no_grad). Rows whose keys are all masked are zero in the fused
kernel's output (a constant), so their tangent is zero.

Shapes: ``[b, heads, s, head_dim]`` (SDPA's layout); keys and values may have fewer heads
(grouped-query attention), each serving ``heads / kv_heads`` consecutive query heads.

A causal mask is aligned to the top left (query ``i`` sees keys ``0..i``, SDPA's ``is_causal``),
or with ``bottom_right`` to the last key (query ``i`` sees keys ``0..i + s_k - s_q``): the
queries are the last ``s_q`` positions of the keys' sequence, as for a context-parallel chunk
(:mod:`megatron_logra.mcore.models.cp_attention`). On CUDA that mask is torch's
``causal_lower_right`` bias, which the flash and memory-efficient kernels apply without
materialising it; elsewhere it is an additive ``[s_q, s_k]`` mask, made once per shape and
dtype and shared by every layer (the CPU flash kernel keeps it for backward by reference).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

# Query rows per block of the tangent rule: bounds its [b, heads, block, s_k] temporaries.
QUERY_BLOCK = 1024


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    *,
    bottom_right: bool = False,
) -> torch.Tensor:
    """``softmax(scale * Q K^T) V``; ``allowed`` (bool, True = may attend, broadcast to
    ``[b, heads, s_q, s_k]``) or ``is_causal`` masks it (aligned to the last key with
    ``bottom_right``)."""
    if any(fwAD.unpack_dual(t).tangent is not None for t in (query, key, value)):
        return _AttentionWithTangent.apply(query, key, value, allowed, is_causal, scale,
                                           bottom_right)
    return _fused(query, key, value, allowed, is_causal, scale, bottom_right)


def _fused(query, key, value, allowed, is_causal, scale, bottom_right=False):  # noqa: ANN001, ANN202
    if is_causal and bottom_right and query.shape[2] != key.shape[2]:
        allowed, is_causal = _bottom_right_mask(query.shape[2], key.shape[2], query), False
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, is_causal=is_causal, scale=scale,
        enable_gqa=key.shape[1] != query.shape[1],
    )


def _bottom_right_mask(s_q: int, s_k: int, query: torch.Tensor) -> Any:
    if s_q > s_k:
        raise ValueError(f"a bottom-right causal mask needs s_q <= s_k, got {s_q} > {s_k}")
    if query.device.type == "cuda":
        return causal_lower_right(s_q, s_k)
    return _additive_bottom_right(s_q, s_k, query.dtype, query.device)


@functools.lru_cache(maxsize=8)
def _additive_bottom_right(s_q: int, s_k: int, dtype: torch.dtype,
                           device: torch.device) -> torch.Tensor:
    """``[s_q, s_k]``: 0 where query ``i`` may attend key ``j <= i + s_k - s_q``, else -inf."""
    query_index = torch.arange(s_q, device=device)[:, None] + (s_k - s_q)
    hidden = torch.arange(s_k, device=device)[None, :] > query_index
    return torch.zeros(s_q, s_k, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


class _AttentionWithTangent(torch.autograd.Function):
    """The fused kernel's output with the exact attention jvp (and a recomputing backward, for
    a forward run with grad mode on inside a dual level)."""

    @staticmethod
    def forward(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        allowed: torch.Tensor | None, is_causal: bool, scale: float, bottom_right: bool,
    ) -> torch.Tensor:
        ctx.save_for_forward(query, key, value)
        ctx.save_for_backward(query, key, value)
        ctx.allowed, ctx.is_causal, ctx.scale = allowed, is_causal, scale
        ctx.bottom_right = bottom_right
        return _fused(query, key, value, allowed, is_causal, scale, bottom_right)

    @staticmethod
    def jvp(ctx: Any, d_query, d_key, d_value, *_: Any) -> torch.Tensor:  # noqa: ANN001
        query, key, value = ctx.saved_tensors
        groups = query.shape[1] // key.shape[1]
        zeros = torch.zeros_like
        d_query = zeros(query) if d_query is None else d_query
        # Grouped-query attention: each key/value head serves `groups` consecutive query heads.
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
        d_key = zeros(key) if d_key is None else d_key.repeat_interleave(groups, dim=1)
        d_value = zeros(value) if d_value is None else d_value.repeat_interleave(groups, dim=1)
        s_q, s_k = query.shape[2], key.shape[2]
        blocks = []
        for start in range(0, s_q, QUERY_BLOCK):
            rows = slice(start, min(start + QUERY_BLOCK, s_q))
            q, dq = query[:, :, rows], d_query[:, :, rows]
            scores = _scores(q, key, ctx.scale)
            d_scores = _scores(dq, key, ctx.scale) + _scores(q, d_key, ctx.scale)
            allowed = _allowed_block(ctx, rows, s_q, s_k, query.device)
            if allowed is not None:
                scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            # A fully masked row: softmax gives NaN, the fused kernel gives a constant zero.
            probs = torch.nan_to_num(probs, nan=0.0)
            centred = d_scores - (probs * d_scores).sum(dim=-1, keepdim=True)
            blocks.append(torch.matmul(probs * centred, value) + torch.matmul(probs, d_value))
        return torch.cat(blocks, dim=2)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            output = _fused(query, key, value, ctx.allowed, ctx.is_causal, ctx.scale,
                            ctx.bottom_right)
        grads = torch.autograd.grad(output, (query, key, value), grad_output)
        return (*grads, None, None, None, None)


def _scores(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * a b^T`` over the last two dimensions."""
    return torch.matmul(a, b.transpose(-1, -2)) * scale


def _allowed_block(ctx: Any, rows: slice, s_q: int, s_k: int,
                   device: torch.device) -> torch.Tensor | None:
    """The mask of query rows ``rows``: True where a query may attend to a key."""
    if ctx.allowed is not None:
        allowed = ctx.allowed
        return allowed[..., rows, :] if allowed.shape[-2] != 1 else allowed
    if not ctx.is_causal:
        return None
    # SDPA's causal mask is aligned to the top left (query i sees keys 0..i); a bottom-right
    # one is shifted by the keys before the first query.
    shift = s_k - s_q if ctx.bottom_right else 0
    query_index = torch.arange(rows.start, rows.stop, device=device)[:, None] + shift
    return torch.arange(s_k, device=device)[None, :] <= query_index
