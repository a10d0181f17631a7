"""Torch LayerNorm / RMSNorm usable under sequence parallelism.

Megatron's local spec falls back to ``WrappedTorchNorm`` when apex is absent, and that wrapper
refuses ``sequence_parallel=True``. Nothing about a torch norm is wrong under SP: each rank
normalises its own sequence shard, and the norm's weight gradient is a partial sum over the
tensor-parallel group that ``finalize_model_grads`` all-reduces for every parameter marked
``sequence_parallel``. This factory marks them.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig


class SequenceParallelTorchNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` per ``config.normalization``.

    A factory (like Megatron's ``WrappedTorchNorm``) rather than a wrapper module, so parameter
    names stay ``...layernorm.weight`` and checkpoints match Megatron's own layout.
    """

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        del persist_layer_norm, zero_centered_gamma, normalization
        if config.layernorm_zero_centered_gamma:
            raise ValueError("zero-centred gamma is not supported by the torch norms")
        if config.normalization == "LayerNorm":
            norm: torch.nn.Module = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization {config.normalization!r} is not LayerNorm or RMSNorm")
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm
