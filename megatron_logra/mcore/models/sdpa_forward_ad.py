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

Bounded blocks: the rule forms ``P`` for a block of query rows at a time, sized so that one
``[b, heads, rows, keys]`` block holds at most :data:`BLOCK_ELEMENTS` elements whatever the
sequence length (at least one row, at most :data:`BLOCK_ROWS`), and under a causal mask a
block reads only the keys its rows can see (``keys = last row + 1``: about half the work of
the square). Two block-sized tensors are alive at a time (the probabilities and the weighted
score tangent, updated in place); grouped-query heads are folded into the rows of their
key/value head, so keys and values are never repeated in memory; nothing is kept after the
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
import math
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

BLOCK_ELEMENTS = 2**24
"""Elements of one ``[b, heads, rows, keys]`` block of the tangent rule (64 MiB in fp32; the rule
holds two): small beside a layer's activations at RL lengths, large enough that each block's
matmuls run at full speed (at 8192 keys and 8 heads a block is 256 query rows)."""
BLOCK_ROWS = 256
"""At most this many query rows per block. Under a causal mask a block computes the whole
rectangle of its rows by the keys its last row sees, so the rectangle's masked corner
(``rows^2 / 2`` per head) is wasted work: at 2048 keys, blocks as large as the element budget
allows (1448 + 600 rows at 8 heads) compute 1.6x the causal triangle, blocks of 256 rows 1.125x."""


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
        ctx.shape = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return _fused(query, key, value, allowed, is_causal, scale, bottom_right)

    @staticmethod
    def jvp(ctx: Any, d_query, d_key, d_value, *_: Any) -> torch.Tensor:  # noqa: ANN001
        query, key, value = ctx.saved_tensors
        batch, heads, s_q, dim = query.shape
        kv_heads, s_k = key.shape[1], key.shape[2]
        groups = heads // kv_heads
        # A bottom-right causal mask: query i sees keys up to i + shift.
        shift = s_k - s_q if ctx.bottom_right else 0
        d_query = torch.zeros_like(query) if d_query is None else d_query
        d_key = torch.zeros_like(key) if d_key is None else d_key
        d_value = torch.zeros_like(value) if d_value is None else d_value
        # One matmul gives the score tangent: [dQ, Q] [K, dK]^T = dQ K^T + Q dK^T.
        keys_both = torch.cat([key, d_key], dim=-1).transpose(-1, -2)  # [b, kv, 2d, s_k]
        # Query heads as rows of their key/value head: [b, kv, groups, s_q, d].
        q5 = query.reshape(batch, kv_heads, groups, s_q, dim)
        dq5 = d_query.reshape(batch, kv_heads, groups, s_q, dim)
        out = query.new_empty(batch, kv_heads, groups, s_q, dim)
        start = 0
        while start < s_q:
            stop = start + _block_rows(ctx, start, s_q, s_k, batch * heads, shift)
            keys = min(s_k, stop + shift) if ctx.is_causal and ctx.allowed is None else s_k
            rows = (stop - start) * groups
            both = torch.cat([dq5[:, :, :, start:stop], q5[:, :, :, start:stop]], dim=-1)
            both = both.reshape(batch, kv_heads, rows, 2 * dim).mul_(ctx.scale)
            d_scores = torch.matmul(both, keys_both[..., :keys])  # scale (dQ K^T + Q dK^T)
            probs = torch.matmul(both[..., dim:], keys_both[..., :dim, :keys])  # scale Q K^T
            del both
            allowed = _allowed_block(ctx, start, stop, keys, groups, query.device)
            if allowed is not None:
                probs.masked_fill_(~allowed, float("-inf"))
            _softmax_(probs)
            if ctx.allowed is not None:
                # A fully masked row: the softmax is NaN, the fused kernel gives a constant zero.
                probs.nan_to_num_(nan=0.0)
            weighted = d_scores.mul_(probs)  # P * dS
            weighted.addcmul_(probs, weighted.sum(dim=-1, keepdim=True), value=-1.0)
            block = torch.matmul(weighted, value[:, :, :keys])
            del weighted
            block += torch.matmul(probs, d_value[:, :, :keys])
            del probs
            out[:, :, :, start:stop] = block.view(batch, kv_heads, groups, stop - start, dim)
            start = stop
        return out.view(batch, heads, s_q, dim)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            output = _fused(query, key, value, ctx.allowed, ctx.is_causal, ctx.scale,
                            ctx.bottom_right)
        grads = torch.autograd.grad(output, (query, key, value), grad_output)
        return (*grads, None, None, None, None)


def _block_rows(ctx: Any, start: int, s_q: int, s_k: int, heads: int, shift: int = 0) -> int:
    """Query rows of the block starting at ``start``: the most whose ``[heads, rows, keys]``
    block fits :data:`BLOCK_ELEMENTS` (``heads`` = batch x query heads), at least one
    (``shift``: the keys a bottom-right causal mask shows each row beyond its own index)."""
    budget = BLOCK_ELEMENTS // heads
    if ctx.is_causal and ctx.allowed is None:
        # rows * (first + rows) <= budget: the block's keys end at its last row.
        first = start + shift
        rows = int((math.isqrt(first * first + 4 * budget) - first) // 2)
    else:
        rows = budget // s_k
    return max(1, min(rows, BLOCK_ROWS, s_q - start))


def _softmax_(scores: torch.Tensor) -> None:
    """Softmax over the last dimension, in place (no second block-sized tensor)."""
    scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
    scores.div_(scores.sum(dim=-1, keepdim=True))


def _allowed_block(ctx: Any, start: int, stop: int, keys: int, groups: int,
                   device: torch.device) -> torch.Tensor | None:
    """Where the block's rows may attend to keys ``0:keys`` (True = may attend), in the block's
    row order (``groups`` query heads of a key/value head, each rows ``start:stop``)."""
    rows = stop - start
    if ctx.allowed is not None:
        batch, heads, s_q, s_k = ctx.shape
        allowed = torch.broadcast_to(ctx.allowed, (batch, heads, s_q, s_k))
        return allowed[:, :, start:stop, :keys].reshape(batch, heads // groups, groups * rows,
                                                        keys)
    if not ctx.is_causal:
        return None
    # SDPA's causal mask is aligned to the top left (query i sees keys 0..i); a bottom-right
    # one is shifted by the keys before the first query.
    shift = ctx.shape[3] - ctx.shape[2] if ctx.bottom_right else 0
    query_index = torch.arange(start, stop, device=device)[:, None] + shift
    allowed = torch.arange(keys, device=device)[None, :] <= query_index
    return allowed.repeat(groups, 1)  # [groups x rows, keys]
