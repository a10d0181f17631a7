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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

# Query rows per block of the tangent rule: bounds its [b, heads, block, s_k] temporaries.
QUERY_BLOCK = 1024


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    """``softmax(scale * Q K^T) V``; ``allowed`` (bool, True = may attend, broadcast to
    ``[b, heads, s_q, s_k]``) or ``is_causal`` masks it."""
    if any(fwAD.unpack_dual(t).tangent is not None for t in (query, key, value)):
        return _AttentionWithTangent.apply(query, key, value, allowed, is_causal, scale)
    return _fused(query, key, value, allowed, is_causal, scale)


def _fused(query, key, value, allowed, is_causal, scale):  # noqa: ANN001, ANN202
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, is_causal=is_causal, scale=scale,
        enable_gqa=key.shape[1] != query.shape[1],
    )


class _AttentionWithTangent(torch.autograd.Function):
    """The fused kernel's output with the exact attention jvp (and a recomputing backward, for
    a forward run with grad mode on inside a dual level)."""

    @staticmethod
    def forward(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        allowed: torch.Tensor | None, is_causal: bool, scale: float,
    ) -> torch.Tensor:
        ctx.save_for_forward(query, key, value)
        ctx.save_for_backward(query, key, value)
        ctx.allowed, ctx.is_causal, ctx.scale = allowed, is_causal, scale
        return _fused(query, key, value, allowed, is_causal, scale)

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
            allowed = _allowed_block(ctx, rows, s_k, query.device)
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
            output = _fused(query, key, value, ctx.allowed, ctx.is_causal, ctx.scale)
        grads = torch.autograd.grad(output, (query, key, value), grad_output)
        return (*grads, None, None, None)


def _scores(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * a b^T`` over the last two dimensions."""
    return torch.matmul(a, b.transpose(-1, -2)) * scale


def _allowed_block(ctx: Any, rows: slice, s_k: int, device: torch.device) -> torch.Tensor | None:
    """The mask of query rows ``rows``: True where a query may attend to a key."""
    if ctx.allowed is not None:
        allowed = ctx.allowed
        return allowed[..., rows, :] if allowed.shape[-2] != 1 else allowed
    if not ctx.is_causal:
        return None
    # SDPA's causal mask is aligned to the top left (query i sees keys 0..i).
    query_index = torch.arange(rows.start, rows.stop, device=device)[:, None]
    return torch.arange(s_k, device=device)[None, :] <= query_index
