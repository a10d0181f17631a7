"""The RL presets, chosen once from ``rl.loss.name``: a policy loss and its advantage estimator.

``paper``: REINFORCE with a detached truncated importance weight, and advantages from a running
baseline with the failure reward and length weighting (megatron_logra.rl.losses /
megatron_logra.rl.advantages have the formulas). ``grpo``: the clipped-ratio surrogate with an
optional k3 reference KL, and group-normalised advantages over each prompt's
``rl.samples_per_prompt`` responses. Both weigh tokens by ``rl.loss.correction`` against the
rollout's log-probs (grpo only when it is not ``none``).

The trainer asks the preset (:func:`build_preset`) instead of testing the loss name: which loss
to call, which ratio it reports, what the advantage estimator logs and checkpoints, and whether a
frozen reference model is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megatron_logra.config import CorrectionConfig, GrpoLossConfig, RLConfig
from megatron_logra.rl.advantages import (
    GroupAdvantageConfig,
    RunningBaselineAdvantage,
    group_normalized_advantages,
)
from megatron_logra.rl.losses import TokenLoss, grpo_policy_loss, paper_policy_loss


class PolicyLoss(Protocol):
    ratio_metric: str
    """The record field of the token-mean ratio the loss reports."""
    clips: bool
    """Whether the loss clips its ratio (reports ``clipped_count``; the step logs
    ``clip_fraction``)."""
    corrects: bool
    """Whether the loss weighs tokens by an importance weight against the rollout's log-probs
    (reports ``importance_weight_sum``, ``importance_ratio_sum`` / ``_max`` and
    ``truncated_count``; megatron_logra.rl.off_policy)."""

    def __call__(
        self, logprobs_BL: torch.Tensor, *, rollout_logprobs_BL: torch.Tensor,
        advantages_B: torch.Tensor, response_mask_BL: torch.Tensor,
        reference_logprobs_BL: torch.Tensor | None,
        old_logprobs_BL: torch.Tensor | None = None,
    ) -> tuple[TokenLoss, torch.Tensor]:
        """The microbatch's loss and the sum of its ratio over valid tokens.

        ``old_logprobs_BL``: the trainer's log-probs before the first update on this rollout
        batch (``rl.updates_per_rollout`` > 1); None: the current ones (one update per batch).
        """
        ...


class AdvantageEstimator(Protocol):
    def compute(
        self, *, rewards: Sequence[float], correct: Sequence[bool], lengths: Sequence[int]
    ) -> torch.Tensor:
        """float32 ``[B]`` advantages of the whole step's batch (every rank passes it all)."""
        ...

    def metrics(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any] | None: ...

    def load_state_dict(self, state: dict[str, Any] | None) -> None: ...


class _TokenPolicyLoss:
    """A per-token loss of ``megatron_logra.rl.losses`` with the sum of the ratio it reports."""

    ratio_metric: str
    ratio_sum_key: str
    clips: bool
    corrects: bool

    def __call__(
        self, logprobs_BL: torch.Tensor, *, rollout_logprobs_BL: torch.Tensor,
        advantages_B: torch.Tensor, response_mask_BL: torch.Tensor,
        reference_logprobs_BL: torch.Tensor | None,
        old_logprobs_BL: torch.Tensor | None = None,
    ) -> tuple[TokenLoss, torch.Tensor]:
        loss = self.loss(logprobs_BL, rollout_logprobs_BL, advantages_B, response_mask_BL,
                         reference_logprobs_BL, old_logprobs_BL)
        return loss, loss.metrics[self.ratio_sum_key]

    def loss(
        self, logprobs_BL: torch.Tensor, rollout_logprobs_BL: torch.Tensor,
        advantages_B: torch.Tensor, response_mask_BL: torch.Tensor,
        reference_logprobs_BL: torch.Tensor | None, old_logprobs_BL: torch.Tensor | None,
    ) -> TokenLoss:
        raise NotImplementedError


class PaperPolicyLoss(_TokenPolicyLoss):
    ratio_metric = "importance_weight_mean"
    ratio_sum_key = "importance_weight_sum"
    clips = False
    corrects = True

    def __init__(self, config: CorrectionConfig) -> None:
        self.config = config

    def loss(self, logprobs_BL, rollout_logprobs_BL, advantages_B, response_mask_BL,
             reference_logprobs_BL, old_logprobs_BL) -> TokenLoss:
        del reference_logprobs_BL
        return paper_policy_loss(logprobs_BL, rollout_logprobs_BL, advantages_B,
                                 response_mask_BL, config=self.config,
                                 old_logprobs_BL=old_logprobs_BL)


class GrpoPolicyLoss(_TokenPolicyLoss):
    ratio_metric = "ratio_mean"
    ratio_sum_key = "ratio_sum"
    clips = True

    def __init__(self, config: GrpoLossConfig,
                 correction: CorrectionConfig | None = None) -> None:
        self.config = config
        self.correction = correction if correction is None or correction.name != "none" \
            else None
        self.corrects = self.correction is not None

    def loss(self, logprobs_BL, rollout_logprobs_BL, advantages_B, response_mask_BL,
             reference_logprobs_BL, old_logprobs_BL) -> TokenLoss:
        # One update per rollout batch: the old policy is the current one (ratio exactly 1).
        old_BL = logprobs_BL.detach() if old_logprobs_BL is None else old_logprobs_BL
        return grpo_policy_loss(logprobs_BL, old_BL, advantages_B,
                                response_mask_BL, config=self.config,
                                reference_logprobs_BL=reference_logprobs_BL,
                                rollout_logprobs_BL=rollout_logprobs_BL,
                                correction=self.correction)


class PaperAdvantages:
    """The running baseline (checkpointed: a resumed run continues it)."""

    def __init__(self, estimator: RunningBaselineAdvantage) -> None:
        self.estimator = estimator

    def compute(
        self, *, rewards: Sequence[float], correct: Sequence[bool], lengths: Sequence[int]
    ) -> torch.Tensor:
        del rewards
        return self.estimator.compute(correct, lengths)

    def metrics(self) -> dict[str, float]:
        return {"baseline": self.estimator.baseline}

    def state_dict(self) -> dict[str, Any] | None:
        return self.estimator.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is None:
            raise ValueError("the checkpoint holds no running-baseline state; it was not written "
                             "by an rl run with rl.loss.name=paper")
        self.estimator.load_state_dict(state)


class GroupAdvantages:
    """Group normalisation: no state across steps."""

    def __init__(self, group_size: int) -> None:
        self.config = GroupAdvantageConfig(group_size=group_size)

    def compute(
        self, *, rewards: Sequence[float], correct: Sequence[bool], lengths: Sequence[int]
    ) -> torch.Tensor:
        del correct, lengths
        return group_normalized_advantages(rewards, self.config)

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        del state


@dataclass(frozen=True)
class RLPreset:
    name: str
    loss: PolicyLoss
    advantages: AdvantageEstimator
    needs_reference_model: bool
    """GRPO with a reference KL keeps a frozen copy of the starting policy."""


def build_preset(rl: RLConfig) -> RLPreset:
    """The preset of ``rl.loss.name`` with its settings."""
    if rl.loss.name == "paper":
        return RLPreset(
            name="paper", loss=PaperPolicyLoss(rl.loss.correction),
            advantages=PaperAdvantages(RunningBaselineAdvantage(rl.advantages.paper)),
            needs_reference_model=False,
        )
    return RLPreset(
        name="grpo", loss=GrpoPolicyLoss(rl.loss.grpo, rl.loss.correction),
        advantages=GroupAdvantages(rl.samples_per_prompt),
        needs_reference_model=rl.loss.grpo.kl_beta > 0,
    )
