"""Per-response advantages for the two RL presets.

``paper`` (LoGRA, arXiv 2610.06647): one response per prompt, a scalar running baseline.

    o_i = 1 if response i is correct else failure_reward            (failure_reward = -0.01)
    A_i = o_i - b                                                    (b from previous batches only)
    b  <- (1 - w) b + w mean_i o_i                                   (w = running_baseline_weight)
    A_i <- A_i * L_ref / L_i                                         (L_ref = 1024, L_i >= 1)

``b`` starts at 0, so the first batch's advantages are the raw outcomes. ``L_i`` is the number of
generated tokens of response i. In a token-mean loss response i's total weight is L_i * A_i;
the length weight makes it L_ref * A_i, so every response counts the same whatever its length
(a short correct answer is not outweighed by a long wrong one).

``grpo``: n responses per prompt, group-normalised rewards

    A_i = (r_i - mean_g) / (std_g + eps)

with the Bessel-corrected (unbiased, divide by n - 1) standard deviation of the group, the usual
choice for GRPO. A group whose rewards are all equal carries no preference among its responses:
its advantages are exactly 0 (set explicitly, not left to floating-point cancellation).

Both estimators must see the whole step's batch (every data-parallel rank's responses, in the same
order everywhere), so that every rank computes the same baseline and the same group statistics.
Arithmetic is float64; the returned tensor is float32 ``[B]`` on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_logra.config import PaperAdvantageConfig


class RunningBaselineAdvantage:
    """The ``paper`` preset's estimator; holds the running baseline across steps."""

    def __init__(self, config: PaperAdvantageConfig) -> None:
        config.validate()
        self.config = config
        self.baseline = 0.0
        self.num_updates = 0

    def compute(self, correct: Sequence[bool], response_lengths: Sequence[int]) -> torch.Tensor:
        """Advantages of one step's responses, then move the baseline by this batch."""
        if len(correct) == 0:
            raise ValueError("correct is empty; pass the correctness of at least one response")
        if len(response_lengths) != len(correct):
            raise ValueError(
                f"response_lengths has {len(response_lengths)} entries but correct has "
                f"{len(correct)}; pass one generated-token count per response"
            )
        for i, length in enumerate(response_lengths):
            if int(length) != length or length < 1:
                raise ValueError(
                    f"response_lengths[{i}]={length!r} must be an integer >= 1 (the number of "
                    "generated tokens, EOS included when it was generated)"
                )
        outcomes = [1.0 if ok else self.config.failure_reward for ok in correct]
        advantages = [o - self.baseline for o in outcomes]
        # The baseline moves only after this batch's advantages are fixed: a response is never
        # compared against a baseline that already contains its own outcome.
        w = self.config.running_baseline_weight
        self.baseline = (1.0 - w) * self.baseline + w * math.fsum(outcomes) / len(outcomes)
        self.num_updates += 1
        reference = self.config.response_length_reference
        if reference is not None:
            advantages = [
                a * reference / length
                for a, length in zip(advantages, response_lengths, strict=True)
            ]
        return torch.tensor(advantages, dtype=torch.float64).float()

    def state_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline, "num_updates": self.num_updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key in ("baseline", "num_updates"):
            if key not in state:
                raise ValueError(
                    f"advantage state has no {key!r} (keys: {sorted(state)}); pass the dict that "
                    "RunningBaselineAdvantage.state_dict() saved"
                )
        baseline = float(state["baseline"])
        if not math.isfinite(baseline):
            raise ValueError(f"advantage state baseline={baseline!r} is not finite")
        self.baseline = baseline
        self.num_updates = int(state["num_updates"])


@dataclass(frozen=True, kw_only=True)
class GroupAdvantageConfig:
    """Knobs of the ``grpo`` preset."""

    group_size: int = 8
    """Responses per prompt, n >= 2 (the unbiased std needs two samples)."""
    epsilon: float = 1e-6
    """Added to the group std so a near-constant group does not blow up."""

    def validate(self) -> None:
        if self.group_size < 2:
            raise ValueError(
                f"group_size={self.group_size!r} must be >= 2; group normalisation needs at least "
                "two responses per prompt (use the paper preset for one response per prompt)"
            )
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"epsilon={self.epsilon!r} must be a positive number, e.g. 1e-6")


def group_normalized_advantages(
    rewards: Sequence[float], config: GroupAdvantageConfig
) -> torch.Tensor:
    """GRPO advantages; ``rewards`` is group-contiguous: prompt j's responses are entries
    ``j*n .. j*n + n - 1``."""
    config.validate()
    n = config.group_size
    if len(rewards) == 0 or len(rewards) % n != 0:
        raise ValueError(
            f"len(rewards)={len(rewards)} must be a positive multiple of group_size={n}; pass "
            "every response of every prompt, grouped by prompt"
        )
    values = torch.tensor([float(r) for r in rewards], dtype=torch.float64).view(-1, n)
    if not torch.isfinite(values).all():
        raise ValueError("rewards contain NaN or infinity; every reward must be a finite number")
    mean = values.mean(dim=1, keepdim=True)
    std = values.std(dim=1, correction=1, keepdim=True)
    advantages = (values - mean) / (std + config.epsilon)
    constant_group = values.amax(dim=1) == values.amin(dim=1)
    advantages[constant_group] = 0.0
    return advantages.reshape(-1).float()
