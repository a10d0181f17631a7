"""Predicted-KL step control on a Megatron model, for any TP / SP / PP / DP / EP layout.

Once per step, after the LoGRA optimizer has prepared its update ``s = -sum_l D_l A_l`` and before
anything is applied:

1. the first-order change of the logits along ``s``, ``dz = J s``, is computed on the probe with
   one forward-mode pass per probe piece (:mod:`megatron_logra.mcore.kl_probe.stream`: the
   low-rank factors are injected at the target layers, tangents flow through Megatron's TP/SP
   Functions and, between pipeline stages, through point-to-point messages; the output layer
   runs chunk by chunk over the counted positions);
2. each chunk's predicted per-token KL ``m = 1/2 Var_p(dz / T)`` is computed in float64 on the
   vocab shards (no vocabulary gather) and summed at once
   (:mod:`megatron_logra.mcore.kl_probe.probe_sums`), then averaged over every probe token of
   every DP rank;
3. the controller turns ``m`` into the step scale ``alpha`` (budget schedule, mismatch EMA, cap);
4. after the update, the *realised* KL between the old and new policies on the same probe tokens
   is measured with a plain pass per piece, the old logits recomputed chunk by chunk from what
   the prediction kept (the final hidden states at the counted positions, and a copy of the
   output weight when it trains), so users can see the prediction is honest.

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

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_logra.config import KLControlConfig
from megatron_logra.controller import KLController, KLDecision
from megatron_logra.kl import TokenSum
from megatron_logra.mcore.kl_probe.logit_jvp import LowRankDirection, PipelinePosition
from megatron_logra.mcore.kl_probe.probe_sums import (
    KeptLogits,
    KLSettings,
    predicted_sums,
    probe_token_mean,
    realised_sums,
)
from megatron_logra.mcore.kl_probe.stream import layout_pieces, length_multiple, refuse_packed
from megatron_logra.mcore.models.sharding import unwrap_model
from megatron_logra.mcore.models.targets import SketchTarget
from megatron_logra.mcore.process_groups import ParallelGroups
from megatron_logra.probe_batch import ProbeBatch, ProbePiece, context_parallel_share
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
        self.controller = KLController(settings)
        self.pipeline = (
            PipelinePosition(groups.pp_rank, groups.pp_size, groups.pp)
            if groups.pp_size > 1 else None
        )
        self.kl = KLSettings(temperature=settings.temperature, tp_group=groups.tp,
                             vocab_size=vocab_size)
        self.batch: ProbeBatch | None = None
        self.decision: KLDecision | None = None
        self._pieces: list[ProbePiece] = []
        self._kept: KeptLogits | None = None
        self.predicted_piece_sums: list[TokenSum] = []
        """This rank's sums of the last prediction, one per laid-out piece (on the ranks that
        hold the output; empty elsewhere)."""
        self.realised_piece_sums: list[TokenSum] = []
        """The same of the last realised-KL measurement."""
        self._seconds = {"predicted": 0.0, "realised": 0.0}

    @property
    def pieces(self) -> list[ProbePiece]:
        """The pieces of the last prediction as this layout ran them (padded, aligned)."""
        return list(self._pieces)

    def set_batch(self, batch: ProbeBatch) -> None:
        refuse_packed(batch.pieces)
        self.batch = batch

    def observe_mismatch(self, observed_gap: float | None) -> float:
        return self.controller.observe_mismatch(observed_gap)

    def _holds_logits(self) -> bool:
        return self.groups.is_last_stage()

    def _global_mean(self, sums: list[TokenSum], what: str) -> float:
        # Every TP rank of the last stage holds the same vocab-reduced sums: TP rank 0 counts.
        contributes = self._holds_logits() and self.groups.tp_rank == 0
        return probe_token_mean(sums, contributes=contributes, group=dist.group.WORLD,
                                device=self.groups.device, what=what)

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state)

    def _layout(self, batch: ProbeBatch) -> list[ProbePiece]:
        # The expert token dispatchers exchange every piece's tokens over the EP group; the
        # all-gather one gathers equal shares.
        align = self.groups.ep if self.groups.ep_size > 1 else None
        config = unwrap_model(self.model_chunks[0]).config
        groups = self.groups
        # Under context parallelism a piece splits into 2 cp equal chunks (of a multiple of TP
        # under sequence parallelism); the CP ranks of a replica hold the same pieces and each
        # runs its own chunks of every one (the attention gathers the keys).
        multiple = length_multiple(self.model_chunks) * (2 * groups.cp_size
                                                         if groups.cp_size > 1 else 1)
        pieces = layout_pieces(batch, multiple=multiple, align_group=align,
                               device=groups.device,
                               same_lengths=config.moe_token_dispatcher_type == "allgather")
        return [context_parallel_share(piece, groups.cp_rank, groups.cp_size, multiple)
                for piece in pieces]

    @torch.no_grad()
    def __call__(self, proposal: ProposedUpdate) -> float:
        """The step scale alpha for a prepared update (collective)."""
        if self.batch is None:
            raise RuntimeError("KLStepControl has no probe batch for this step (set_batch)")
        start = time.perf_counter()
        proposals = {key: LowRankDirection(left, right)
                     for key, (left, right) in proposal.directions.items()}
        self._pieces = self._layout(self.batch)
        self._kept = None
        sums, self._kept = predicted_sums(
            self.model_chunks, self._pieces, targets=self.targets, directions=proposals,
            kl=self.kl, pipeline=self.pipeline, holds_output=self._holds_logits(), keep=True,
        )
        self.predicted_piece_sums = sums
        predicted = self._global_mean(sums, "predicted")
        self.decision = self.controller.decide(predicted,
                                               completed_updates=proposal.completed_updates)
        self._seconds["predicted"] = time.perf_counter() - start
        return self.decision.alpha

    @torch.no_grad()
    def realised(self) -> float:
        """KL(old policy || new policy) per probe token, measured after the update."""
        if self.batch is None:
            raise RuntimeError("no probe batch")
        if self._holds_logits() and self._pieces and self._kept is None:
            raise RuntimeError("realised() needs the logits of a preceding prediction")
        start = time.perf_counter()
        try:
            sums = realised_sums(self.model_chunks, self._pieces, self._kept, kl=self.kl,
                                 pipeline=self.pipeline, holds_output=self._holds_logits())
        finally:
            self._kept = None
        self.realised_piece_sums = sums
        mean = self._global_mean(sums, "realised")
        self._seconds["realised"] = time.perf_counter() - start
        return mean

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
            # This rank's wall time of the step's two probe passes (forward-mode and realised).
            "kl_probe_time_s": self._seconds["predicted"] + self._seconds["realised"],
        }
