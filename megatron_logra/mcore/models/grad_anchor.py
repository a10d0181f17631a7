"""Make a frozen model's decoder input require grad, so backward reaches what trains inside.

When every parameter up to the first decoder layer is frozen (LoGRA's paper mode, where only the
sketched linears train; LoRA, where only the adapters do), the embedding's output does not
require grad. Without recompute autograd still reaches the trainable tensors deeper in, but
Megatron's full activation recompute is a reentrant ``CheckpointFunction``: it tracks only its
tensor inputs, so with a hidden state that does not require grad its output does not either, and
backward never runs the recomputed layers (``element 0 of tensors does not require grad``). The
anchor is a forward hook on the embedding that marks its output as requiring grad while grad
mode is on; no parameter gets a gradient from it. Later pipeline stages receive their inputs
from Megatron's schedule with requires_grad set already.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_logra.mcore.models.sharding import unwrap_model


def anchor_embedding_output(model_chunks: Sequence[torch.nn.Module]) -> None:
    """Register the anchor on the embedding of every chunk that has one (the first stage)."""
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        embedding = getattr(model, "embedding", None)
        if embedding is not None and getattr(model, "pre_process", False):
            embedding.register_forward_hook(_require_grad_output)


def _require_grad_output(module: torch.nn.Module, args: object, output: torch.Tensor):
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.requires_grad_(True)
    return output
