"""The Transformer Engine modules of ``model.attention=te`` (GPU only, imported on demand).

Transformer Engine cannot be installed on the CPU machines (its presence even breaks
``import megatron.core`` there), so nothing imports this module's TE names until a ``te`` model
is built. Only TE's fused attention and its norms are used. The target linears stay our
sketch-capable Megatron linears, and each norm stays a separate module in front of its linear:
TE's fused ``TELayerNormColumnParallelLinear`` (Megatron's default TE spec for ``linear_qkv`` and
``linear_fc1``) keeps the normalised input X for its weight gradient inside one kernel, and a
sketched layer must keep ``P = X A^T`` instead of X -- so the fusion would store exactly the
activation LoGRA exists to avoid. The parameter names (``input_layernorm.weight``, ...) are
the local spec's, so checkpoints move between ``te``, ``sdpa`` and ``local`` unchanged.

The KL probe's forward-mode AD has no rules for TE's kernels (TE defines no ``jvp``), so the
config refuses ``model.attention=te`` together with ``logra.kl_control.enabled``.
"""

from __future__ import annotations


def transformer_engine_modules() -> tuple[type, type]:
    """``(norm, core attention)``: Megatron's ``TENorm`` and ``TEDotProductAttention``."""
    try:
        import transformer_engine  # noqa: F401  (the import Megatron's wrappers need)
        from megatron.core.extensions.transformer_engine import TEDotProductAttention, TENorm
    except ImportError as error:
        raise ValueError(
            f"model.attention=te needs Transformer Engine, which does not import here ({error}); "
            "install transformer-engine[pytorch] on a GPU machine, or use model.attention=sdpa"
        ) from error
    return TENorm, TEDotProductAttention
