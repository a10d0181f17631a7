"""Predicted-KL step control on a Megatron model, for any TP / SP / PP / DP layout.

Once per step, after the LoGRA optimizer has prepared its update ``s = -sum_l D_l A_l`` and before
anything is applied:

1. the first-order change of the logits along ``s``, ``dz = J s``, is computed on the probe batch
   with one forward-mode pass (:func:`megatron_logra.mcore.kl_probe.logit_jvp.logit_jvp`: the low-rank
   factors are injected at the target layers, tangents flow through Megatron's TP/SP Functions
   and, between pipeline stages, through point-to-point messages);
2. the predicted per-token KL ``m = 1/2 Var_p(dz / T)`` is computed in float64 on the vocab
   shards (no vocabulary gather) and averaged over every probe token of every DP rank;
3. the controller turns ``m`` into the step scale ``alpha`` (budget schedule, mismatch EMA, cap);
4. after the update, the *realised* KL between the old and new policies on the same probe tokens
   is measured with a second forward, so users can see the prediction is honest.

Why forward-mode AD rather than finite differences: at realistic step sizes (~1e-4 of the weights)
fp32 finite differences carry 1e-4..1e-3 relative error and bf16 ones are useless, while the JVP is
exact to rounding at every layout (measured in docs/LOG.md and tests/distributed).

It is the LoGRA optimizer's step scale (``megatron_logra.step_scale.StepScale``): the optimizer,
built with it, calls it with each prepared :class:`~megatron_logra.step_scale.ProposedUpdate` and
checkpoints its state; the trainer only gives it each step's probe batch and the measured
rollout/trainer mismatch, and reads its metrics after the step.

Every rank calls every method (the forwards are collective); the numbers returned are identical on
all ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_logra.config import KLControlConfig
from megatron_logra.controller import KLController, KLDecision
from megatron_logra.kl import TokenSum, exact_kl_vocab_parallel, predicted_kl_vocab_parallel
from megatron_logra.mcore.kl_probe.logit_jvp import (
    LowRankDirection,
    PipelinePosition,
    logit_jvp,
    probe_logits,
)
from megatron_logra.mcore.models.sharding import unwrap_model
from megatron_logra.mcore.models.targets import SketchTarget
from megatron_logra.mcore.process_groups import ParallelGroups
from megatron_logra.probe_batch import ProbeBatch, context_parallel_share
from megatron_logra.step_scale import ProposedUpdate


class KLStepControl:
    """Owns the controller state and the probe; called with a proposed update, returns alpha.

    Args:
        model_chunks: this rank's (DDP-wrapped) model chunks.
        targets: the sketched linears the proposals' directions belong to.
        settings: the run's logra.kl_control section (resolved: its temperature is set).
        groups: process groups of this rank.
        vocab_size: the tokenizer's vocabulary (padded ids are excluded from the softmax).
    """

    def __init__(
        self,
        model_chunks: Sequence[torch.nn.Module],
        targets: Sequence[SketchTarget],
        *,
        settings: KLControlConfig,
        groups: ParallelGroups,
        vocab_size: int,
    ) -> None:
        if settings.temperature is None:
            raise RuntimeError("KLStepControl needs a resolved config (Config.resolved sets "
                               "logra.kl_control.temperature)")
        self.model_chunks = list(model_chunks)
        self.targets = list(targets)
        self.groups = groups
        self.temperature = settings.temperature
        self.vocab_size = vocab_size
        self.controller = KLController(settings)
        self.pipeline = (
            PipelinePosition(groups.pp_rank, groups.pp_size, groups.pp)
            if groups.pp_size > 1 else None
        )
        self.batch: ProbeBatch | None = None
        self.decision: KLDecision | None = None
        self._logits_before: torch.Tensor | None = None

    def set_batch(self, batch: ProbeBatch) -> None:
        if batch.mask.dtype != torch.bool or batch.mask.shape != batch.tokens.shape:
            raise ValueError(
                f"probe mask must be a bool tensor shaped like the tokens {tuple(batch.tokens.shape)}"
                f", got {batch.mask.dtype} {tuple(batch.mask.shape)}"
            )
        groups = self.groups
        sequence_parallel = unwrap_model(self.model_chunks[0]).config.sequence_parallel
        # Each CP rank probes its own chunks of the probe sequences: their sums add up over the
        # DP x CP ranks in _global_mean, as the DP replicas' do.
        self.batch = context_parallel_share(
            batch, groups.cp_rank, groups.cp_size,
            2 * groups.cp_size * (groups.tp_size if sequence_parallel else 1))

    def observe_mismatch(self, observed_gap: float | None) -> float:
        return self.controller.observe_mismatch(observed_gap)

    def _holds_logits(self) -> bool:
        return self.groups.is_last_stage()

    def _global_mean(self, local: TokenSum | None, what: str) -> float:
        """Token mean over every DP rank's probe. Vocab-parallel sums are complete on every TP
        rank of the last stage: TP rank 0 of the last stage contributes, others add zeros."""
        total = torch.zeros(2, dtype=torch.float64, device=self.groups.device)
        if local is not None and self._holds_logits() and self.groups.tp_rank == 0:
            total[0], total[1] = local.total, local.count
        dist.all_reduce(total)
        if total[1] <= 0:
            raise RuntimeError(f"no probe tokens on any rank to measure the {what} KL")
        return float(total[0] / total[1])

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state)

    @torch.no_grad()
    def __call__(self, proposal: ProposedUpdate) -> float:
        """The step scale alpha for a prepared update (collective)."""
        if self.batch is None:
            raise RuntimeError("KLStepControl has no probe batch for this step (set_batch)")
        proposals = {key: LowRankDirection(left, right)
                     for key, (left, right) in proposal.directions.items()}
        result = None
        # A DP replica holding none of the global probe sequences skips the forward; all ranks
        # of its model-parallel group hold the same (empty) batch, so they skip together.
        if self.batch.tokens.shape[0] > 0:
            result = logit_jvp(
                self.model_chunks, self.batch.tokens, self.batch.position_ids,
                targets=self.targets, directions=proposals, pipeline=self.pipeline,
            )
        local = None
        self._logits_before = None
        if result is not None:
            local = predicted_kl_vocab_parallel(
                result.logits, result.tangent, temperature=self.temperature,
                tp_group=self.groups.tp, mask=self._logit_mask(), vocab_size=self.vocab_size,
            )
            self._logits_before = result.logits
        predicted = self._global_mean(local, "predicted")
        self.decision = self.controller.decide(predicted,
                                               completed_updates=proposal.completed_updates)
        return self.decision.alpha

    @torch.no_grad()
    def realised(self) -> float:
        """KL(old policy || new policy) per probe token, measured after the update."""
        if self.batch is None:
            raise RuntimeError("no probe batch")
        after = None
        if self.batch.tokens.shape[0] > 0:
            after = probe_logits(self.model_chunks, self.batch.tokens, self.batch.position_ids,
                                 pipeline=self.pipeline)
        local = None
        if after is not None:
            if self._logits_before is None:
                raise RuntimeError("realised() needs the logits of a preceding prediction")
            local = exact_kl_vocab_parallel(
                self._logits_before, after, temperature=self.temperature,
                tp_group=self.groups.tp, mask=self._logit_mask(), vocab_size=self.vocab_size,
            )
        self._logits_before = None
        return self._global_mean(local, "realised")

    def _logit_mask(self) -> torch.Tensor:
        # GPTModel returns logits as [b, s, V_local], aligned with the tokens.
        return self.batch.mask

    def metrics(self, realised: float) -> dict[str, float]:
        decision = self.decision
        if decision is None:
            raise RuntimeError("no decision this step")
        return {
            "kl_predicted": decision.kl_predicted,
            "kl_predicted_scaled": decision.kl_predicted_scaled,
            "kl_realized": realised,
            "alpha": decision.alpha,
            "kl_budget": decision.kl_budget,
            "kl_budget_effective": decision.kl_budget_effective,
            "mismatch": decision.mismatch,
        }
