"""Megatron-Core 0.16 MoE on machines without Transformer Engine or CUDA (applied explicitly).

1. ``RouterGatingLinearFunction.forward`` (``transformer/moe/moe_utils.py``) tests
``te_general_gemm is not None``, but that name is only bound when Transformer Engine imports:
without TE every MoE forward raises ``NameError``. Binding it to None selects the function's own
``torch.mm`` branch, the one it takes for fp64 routing anyway.

2. The all-to-all dispatcher's split sizes. ``MoEAlltoAllTokenDispatcher`` moves its split-size
tensors to the host with ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts only
CUDA tensors: on CPU they stay tensors and ``all_to_all_single`` rejects them as split sizes.
The dispatcher's copy of the helper is wrapped to convert host tensors too.

Applied by the MoE layer spec
(:func:`megatron_logra.mcore.models.moe.moe_mlp_spec`), before any MoE layer is built.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe import moe_utils, token_dispatcher

_original_move = moe_utils.maybe_move_tensor_to_cpu


def _move_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
        return tensor.numpy()
    return _original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)


def apply_moe_fixes() -> None:
    """Install both fixes (idempotent)."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    token_dispatcher.maybe_move_tensor_to_cpu = _move_to_host
