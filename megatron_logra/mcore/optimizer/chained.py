"""Megatron's native optimizer(s) and a :class:`LoGRAOptimizer` under one ``step()``.

:class:`LoGRAChainedOptimizer` is Megatron's ``ChainedOptimizer`` with one change: the global
gradient norm counts every sketch as the gradient it stands for, the reconstructed ``S A``
(computed through ``A A^T``, never by reconstruction), so a single norm and a single clip
coefficient cover dense and sketched parameters alike. With ``A = I`` that norm is exactly the
dense gradient norm of an ordinary Megatron run. Its ``step()`` is Megatron's: no arguments,
``(success, grad_norm, num_zeros_in_grad)`` back; what differs between the LoGRA modes and the
step scale were given to the LoGRA optimizer at construction.
"""

from __future__ import annotations

import math

import torch
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer.optimizer import ChainedOptimizer, MegatronOptimizer

from megatron_logra.mcore.optimizer.logra import LoGRAOptimizer


class LoGRAChainedOptimizer(ChainedOptimizer):
    """Megatron's native optimizer(s) and a :class:`LoGRAOptimizer` under one global norm."""

    def __init__(self, native: MegatronOptimizer, logra: LoGRAOptimizer) -> None:
        natives = list(native.chained_optimizers) if isinstance(native, ChainedOptimizer) else [
            native
        ]
        # A stub (a rank whose native parameters are all frozen, e.g. paper mode) holds no
        # optimizer; Megatron's chain cannot checkpoint one, and it has nothing to step.
        natives = [opt for opt in natives if not getattr(opt, "is_stub_optimizer", False)]
        super().__init__(natives + [logra])
        self.native_optimizers = natives
        self.logra = logra
        # Megatron's own norm over the native parameters (its grad-stats groups, its filters).
        self._native_chain = ChainedOptimizer(natives) if natives else None

    def _native_norm(self) -> float:
        return self._native_chain.get_grad_norm() if self._native_chain else 0.0

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        return self.logra.mode.grad_norm(
            native_norm=self._native_norm,
            reconstructed_sq_norm=self.logra.sketch_sq_norm,
            sketch_frobenius_sq=self.logra.sketch_frobenius_sq,
        )

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, float | None]:
        """As ``ChainedOptimizer.step``, with the sketches inside the norm and the clip.

        Order: grads ready (sketch finite) -> global norm (finite) -> clip (when the mode clips;
        the paper's update is sized by its update ratio instead) -> LoGRA prepares its directions and decides their
        scale (e.g. from the predicted KL, computed at the current weights, so before anything
        moves), the directions, ratio factor, alpha and merged factors checked finite on every
        rank -> the native optimizers step -> the LoGRA update is applied.
        """
        found_inf_flag = self.prepare_grads()
        if found_inf_flag:
            return False, None, None
        grad_norm = self.get_grad_norm()
        # The global norm covers every native gradient (Megatron's fp32 optimizers check none
        # for NaN themselves) and every sketch; it is the same number on every rank.
        if not math.isfinite(grad_norm):
            raise RuntimeError(
                f"non-finite gradient norm {grad_norm} at update {self.logra.update_count + 1} "
                "(a NaN or inf loss, or an overflow in backward); no weight was changed"
            )
        if self.config.clip_grad > 0.0 and self.logra.mode.clips_gradients:
            for optimizer in self.native_optimizers:
                if getattr(optimizer, "is_stub_optimizer", False):
                    continue
                parameters = optimizer.get_parameters()
                if parameters:
                    clip_grad_by_total_norm_fp32(
                        parameters,
                        max_norm=optimizer.config.clip_grad,
                        total_norm=grad_norm,
                        use_decoupled_grad=(
                            optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                        ),
                    )
            self.logra.clip_sketches_(self.config.clip_grad, grad_norm)
        num_zeros_in_grad = None
        if self.config.log_num_zeros_in_grad:
            num_zeros_in_grad = sum(
                opt.count_zeros() for opt in self.native_optimizers
            ) + self.logra.count_zeros()
        # Checked on every rank before any optimizer moves a weight.
        scale = self.logra.prepare_checked_update()
        success = True
        for optimizer in self.native_optimizers:
            success &= optimizer.step_with_ready_grads()
        self.logra.apply_update(scale)
        return success, grad_norm, num_zeros_in_grad
