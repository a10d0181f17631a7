"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``: no ``s x s`` storage.

Megatron's local ``DotProductAttention`` materialises the ``[b, heads/tp, s, s]`` scores and
their softmax and keeps the probabilities for backward -- per layer, quadratic in the sequence.
:class:`SDPAttention` is a drop-in for it in the layer spec
(``self_attention.submodules.core_attention``): the same constructor and call signature, the
same ``[s, b, heads/tp, head_dim]`` inputs and ``[s, b, hidden/tp]`` output, computed by PyTorch's
fused kernels (flash / memory-efficient on GPU, the flash kernel on CPU), which keep only the
output and a per-row log-sum-exp for backward.

Masks follow Megatron's conventions: an explicit ``attention_mask`` (bool, True = masked,
broadcastable to ``[b, 1, s_q, s_k]``; the sampler's padding masks) is used as given; without
one a causal layer masks causally, except for a single query row (a KV-cache decode step, which
sees its whole cached prefix). A query row whose keys are all masked (a left-padding position
in the sampler's prefill) outputs zeros, where Megatron's masked_fill(-10000) softmax averages
the values; those positions are never read.

Tensor parallelism needs nothing here: Megatron's ``SelfAttention`` already hands each rank its
own heads. Grouped-query attention is read from the shapes (fewer key/value heads than query
heads) and uses SDPA's ``enable_gqa``, so keys and values are never repeated in memory.
Forward-mode AD (the KL probe) goes through the tangent rule of
:mod:`megatron_logra.mcore.models.sdpa_forward_ad`.

Context parallelism: with ``context_parallel_size > 1`` a causal layer without an explicit mask
runs :func:`~megatron_logra.mcore.models.cp_attention.context_parallel_attention` over Megatron's
CP group (keys and values all-gathered, exact). ``cp_group = None`` makes the layer attend
within its rank's own tokens (``mcore/models/context_parallel.py``: the sampler's whole
sequences).

Packed sequences (Megatron's ``thd`` ``PackedSeqParams``) are attended one causal block per
sequence (:mod:`megatron_logra.mcore.models.packed_attention`); under context parallelism each
sequence of the row is split into ``2 cp`` chunks and its keys and values gathered over the CP
group (:mod:`megatron_logra.mcore.models.packed_cp_attention`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_logra.mcore.models.cp_attention import context_parallel_attention
from megatron_logra.mcore.models.packed_attention import packed_sdpa
from megatron_logra.mcore.models.packed_cp_attention import packed_context_parallel_attention
from megatron_logra.mcore.models.sdpa_forward_ad import attention


class SDPAttention(MegatronModule):
    """Causal (grouped-query) softmax attention of one layer's local heads."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
    ):
        super().__init__(config=config)
        del attention_type, cp_comm_type  # the heads arrive already split per rank
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        # Megatron's context-parallel group when the sequence is split (None: not split).
        self.cp_group: dist.ProcessGroup | None = None
        if config.context_parallel_size > 1:
            self.cp_group = getattr(pg_collection, "cp", None)
            if self.cp_group is None:
                raise ValueError("context parallelism needs Megatron's pg_collection with its "
                                 "CP group (built by SelfAttention)")
        unsupported = {
            "attention dropout": dropout != 0.0,
            "window attention": config.window_size is not None,
            f"softmax_type={config.softmax_type!r}": config.softmax_type != "vanilla",
        }
        for what, present in unsupported.items():
            if present:
                raise ValueError(
                    f"{what} is not supported by model.attention=sdpa; use model.attention=te "
                    "(GPU) or model.attention=local"
                )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        head_dim = config.kv_channels
        # Megatron's query-key layer scaling divides the scale by the layer number and the fused
        # softmax multiplies it back: the same scale, so it needs no term here.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """``[s_q, b, heads, d]`` queries, ``[s_k, b, kv_heads, d]`` keys and values ->
        ``[s_q, b, heads * d]``."""
        if attention_bias is not None:
            raise ValueError("attention bias needs model.attention=te")
        if packed_seq_params is not None:
            if attention_mask is not None:
                raise ValueError("packed sequences take no attention mask: each sequence "
                                 "attends causally to itself")
            if self.cp_group is not None:
                return packed_context_parallel_attention(
                    query, key, value, packed_seq_params, group=self.cp_group,
                    scale=self.softmax_scale)
            # thd: [T, heads, d], one causal block per sequence (packed_attention.py).
            return packed_sdpa(query, key, value, packed_seq_params, self.softmax_scale)
        s_q, batch, heads, head_dim = query.shape
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if self.cp_group is not None:
            if attention_mask is not None or mask_type != AttnMaskType.causal:
                raise ValueError(
                    "context-parallel attention is causal over the split sequence; an explicit "
                    "attention mask (the sampler's) needs context_parallel_off(model)"
                )
            context = context_parallel_attention(query, key, value, group=self.cp_group,
                                                 scale=self.softmax_scale)
            return context.permute(2, 0, 1, 3).reshape(s_q, batch, heads * head_dim)
        allowed = None
        is_causal = False
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise TypeError(
                    f"attention_mask must be boolean (True = masked), got {attention_mask.dtype}"
                )
            allowed = ~attention_mask
        elif mask_type == AttnMaskType.causal and s_q > 1:
            if key.shape[0] != s_q:
                raise ValueError(
                    f"a causal mask needs as many keys as queries, got {key.shape[0]} and {s_q}"
                )
            is_causal = True
        # [s, b, h, d] -> [b, h, s, d], SDPA's layout.
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = attention(query, key, value, allowed, is_causal, self.softmax_scale)
        return context.permute(2, 0, 1, 3).reshape(s_q, batch, heads * head_dim)

