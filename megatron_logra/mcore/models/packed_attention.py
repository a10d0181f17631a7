"""Packed sequences through Megatron's GPT: ``PackedSeqParams`` (``thd``) and block-diagonal
causal attention that is exact on every core attention we build.

A packed microbatch is one row ``[1, T]`` holding several whole sequences. Megatron's interface
for it is ``PackedSeqParams(qkv_format="thd", cu_seqlens_q, cu_seqlens_q_padded, ...)`` passed
to ``GPTModel.forward``: RoPE restarts at every sequence (Megatron's ``thd`` rotary path splits
the row at ``cu_seqlens_q_padded``), learned positions come from the row's position ids
(restarting too), and core attention gets ``[T, heads, d]`` queries, keys and values with the
params. Each core attention then attends within each sequence only (block-diagonal causal):

* ``te``: Transformer Engine's fused attention takes ``thd`` natively (padding-causal mask);
* ``sdpa`` (:func:`packed_sdpa`) and ``local`` (:class:`PackedDotProductAttention`): the
  unpacked kernel on each block in turn, exactly the computation the padded path does for that
  sequence (a sequence padded at its end never attends to its padding). Per block, not with a
  ``T x T`` block mask: memory and work follow ``sum(L_i^2)``, not ``T^2``. Forward-mode AD (the
  KL probe) goes through the same blocks, each by the SDPA tangent rule
  (:mod:`.sdpa_forward_ad`) or by autograd's own rules for ``local``'s ops.

Blocks: each sequence's real tokens ``[start_i, start_i + L_i)`` form one block, the padding
after them (up to the next sequence's start) another, so a real token sees exactly its own
sequence's earlier tokens; padding outputs are finite and never read.
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_logra.mcore.models.sdpa_forward_ad import attention
from megatron_logra.packing.rows import RowLayout


def packed_seq_params(layout: RowLayout, device: torch.device | str) -> PackedSeqParams:
    """Megatron's ``thd`` parameters of a packed row: real lengths in ``cu_seqlens_*``, where
    each sequence sits (its span, padding included) in ``cu_seqlens_*_padded``."""
    real = layout.cu_seqlens(device)
    spans = layout.cu_seqlens_padded(device)
    longest = max(layout.spans)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=spans,
        cu_seqlens_kv_padded=spans, max_seqlen_q=longest, max_seqlen_kv=longest,
    )


def attention_blocks(params: PackedSeqParams, tokens: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the causal blocks of a row of ``tokens``: each sequence's real
    tokens, then the padding after them (if any)."""
    if params.qkv_format != "thd":
        raise ValueError(f"packed sequences need qkv_format='thd', got {params.qkv_format!r}")
    real = params.cu_seqlens_q.tolist()
    spans = (params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None
             else params.cu_seqlens_q).tolist()
    if spans[-1] != tokens:
        raise ValueError(f"the packed row has {tokens} tokens but its sequences span {spans[-1]}")
    blocks = []
    for i in range(len(spans) - 1):
        start, end = spans[i], spans[i + 1]
        middle = start + real[i + 1] - real[i]
        blocks.extend(block for block in ((start, middle), (middle, end)) if block[1] > block[0])
    return blocks


def packed_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                params: PackedSeqParams, scale: float) -> torch.Tensor:
    """``[T, heads, d]`` queries and ``[T, kv_heads, d]`` keys / values -> ``[T, 1, heads * d]``,
    causal softmax attention within each block."""
    tokens, heads, head_dim = query.shape
    outputs = []
    for start, end in attention_blocks(params, tokens):
        # [L, h, d] -> [1, h, L, d], SDPA's layout.
        q, k, v = (t[start:end].permute(1, 0, 2)[None] for t in (query, key, value))
        out = attention(q, k, v, None, True, scale)
        outputs.append(out[0].permute(1, 0, 2).reshape(end - start, heads * head_dim))
    return torch.cat(outputs)[:, None]


class PackedDotProductAttention(DotProductAttention):
    """Megatron's ``DotProductAttention`` (``model.attention=local``), unchanged without packed
    sequences; with them, the same computation on each causal block of the row."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias)
        if attention_mask is not None or self.attn_mask_type != AttnMaskType.causal:
            raise ValueError("packed sequences take no attention mask: each sequence attends "
                             "causally to itself")
        outputs = [
            super(PackedDotProductAttention, self).forward(
                query[start:end, None], key[start:end, None], value[start:end, None], None,
                AttnMaskType.causal, attention_bias)
            for start, end in attention_blocks(packed_seq_params, query.shape[0])
        ]
        return torch.cat(outputs)
