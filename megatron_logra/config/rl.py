"""The ``rl`` section and its parts: sampling, the policy loss, advantages, the reward (with
math-verify's settings) and held-out evaluation.

The small per-component configs (``GrpoLossConfig``, ``CorrectionConfig``,
``PaperAdvantageConfig``, ``RewardConfig``) are the very objects the ``megatron_logra.rl``
functions take: a knob is declared once, here, and reaches its user unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_logra.config.checks import (
    check_choice,
    check_fraction,
    check_positive,
    validate_subsections,
)
from megatron_logra.config.off_policy import CorrectionConfig

RL_LOSSES: tuple[str, ...] = ("paper", "grpo")
"""Loss presets; each also fixes its advantage estimator (megatron_logra.rl.presets)."""
REWARDS: tuple[str, ...] = ("exact_match", "math_verify")
"""Rewards (megatron_logra.rl.rewards maps each name to its class)."""
FAILURE_POLICIES: tuple[str, ...] = ("zero_reward", "raise")
# Which held-out problems rl evaluates: the test split runs report, or the validation split
# settings are chosen on (megatron_logra.data.dataset_dir.EVAL_SPLIT_FILES maps them to files).
EVAL_SPLITS: tuple[str, ...] = ("test", "validation")
# fork is left out: the trainer process holds threads and process-group sockets that a forked
# child would inherit in an undefined state.
START_METHODS: tuple[str, ...] = ("spawn", "forkserver")


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How rollouts are sampled."""

    max_new_tokens: int = 8
    temperature: float = 1.0
    """Sampling temperature of the rollouts (also the KL controller's, see
    logra.kl_control.temperature)."""
    top_p: float = 1.0

    def validate(self, path: str = "rl.sampling") -> None:
        check_positive(f"{path}.max_new_tokens", self.max_new_tokens)
        check_positive(f"{path}.temperature", self.temperature)
        check_fraction(f"{path}.top_p", self.top_p, closed="high")


@dataclass(frozen=True, kw_only=True)
class GrpoLossConfig:
    """The ``grpo`` loss: PPO-style clipped surrogate and an optional k3 reference KL."""

    clip_low: float = 0.2
    """The ratio is clipped below at ``1 - clip_low``; in [0, 1)."""
    clip_high: float = 0.2
    """The ratio is clipped above at ``1 + clip_high``; >= 0."""
    kl_beta: float = 0.0
    """Weight of the k3 reference-KL penalty; 0 turns it off (no reference model is kept)."""

    def validate(self, path: str = "rl.loss.grpo") -> None:
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"{path}.clip_low={self.clip_low!r} must be in [0, 1), e.g. 0.2")
        if not (math.isfinite(self.clip_high) and self.clip_high >= 0.0):
            raise ValueError(
                f"{path}.clip_high={self.clip_high!r} must be a number >= 0, e.g. 0.2"
            )
        if not (math.isfinite(self.kl_beta) and self.kl_beta >= 0.0):
            raise ValueError(
                f"{path}.kl_beta={self.kl_beta!r} must be a number >= 0 (0 disables the KL)"
            )


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The policy-loss preset and the settings of each preset (only the chosen one's act)."""

    name: str = "paper"
    """``paper``: REINFORCE with a running baseline, failure reward, length weighting and a
    detached truncated importance weight; ``grpo``: group-normalised advantages over
    rl.samples_per_prompt responses, clipped ratio, optional k3 reference KL."""
    grpo: GrpoLossConfig = field(default_factory=GrpoLossConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """The importance weights against the rollout engine's log-probs (both presets; the
    paper's truncated weight is ``tis`` with ``tis_cap`` 2)."""

    def validate(self, path: str = "rl.loss") -> None:
        check_choice(f"{path}.name", self.name, RL_LOSSES)
        validate_subsections(self, path)


@dataclass(frozen=True, kw_only=True)
class PaperAdvantageConfig:
    """Knobs of the ``paper`` preset's advantages (defaults are the paper's)."""

    failure_reward: float = -0.01
    """Outcome of an incorrect response; slightly negative, so a batch with no correct response
    still pushes probability away from what was sampled."""
    running_baseline_weight: float = 0.1
    """w in ``b <- (1 - w) b + w mean(o)``; in (0, 1]."""
    response_length_reference: float | None = 1024.0
    """L_ref in ``A_i * L_ref / L_i``; None turns length weighting off."""

    def validate(self, path: str = "rl.advantages.paper") -> None:
        if not math.isfinite(self.failure_reward):
            raise ValueError(
                f"{path}.failure_reward={self.failure_reward!r} must be a finite number"
            )
        if not 0.0 < self.running_baseline_weight <= 1.0:
            raise ValueError(
                f"{path}.running_baseline_weight={self.running_baseline_weight!r} must be in "
                "(0, 1]; the paper uses 0.1"
            )
        if self.response_length_reference is not None and not (
            math.isfinite(self.response_length_reference) and self.response_length_reference > 0
        ):
            raise ValueError(
                f"{path}.response_length_reference={self.response_length_reference!r} must be a "
                "positive number (the paper uses 1024) or None to turn length weighting off"
            )


@dataclass(frozen=True, kw_only=True)
class AdvantagesConfig:
    """Advantage settings per preset. ``grpo`` normalises rewards within each prompt's
    rl.samples_per_prompt responses and has no knobs of its own."""

    paper: PaperAdvantageConfig = field(default_factory=PaperAdvantageConfig)

    def validate(self, path: str = "rl.advantages") -> None:
        validate_subsections(self, path)


@dataclass(frozen=True, kw_only=True)
class MathVerifyConfig:
    """The math-verify grader's worker pool and its deadlines."""

    num_workers: int = 2
    """Grading processes."""
    batch_timeout_s: float = 60.0
    """Wall-clock limit for grading one batch, counted once the pool is ready."""
    startup_timeout_s: float = 60.0
    """Limit for the workers to start and import math-verify."""
    parsing_timeout_s: int = 5
    """math-verify's own per-parse alarm, whole seconds."""
    verify_timeout_s: int = 5
    """math-verify's own per-comparison alarm, whole seconds."""
    start_method: str = "spawn"
    """Multiprocessing start method of the workers."""

    def validate(self, path: str = "rl.reward.math_verify") -> None:
        check_choice(f"{path}.start_method", self.start_method, START_METHODS)
        if self.num_workers < 1:
            raise ValueError(f"{path}.num_workers={self.num_workers!r} must be >= 1")
        for name in ("batch_timeout_s", "startup_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{path}.{name}={value!r} must be a positive number of seconds")
        for name in ("parsing_timeout_s", "verify_timeout_s"):
            value = getattr(self, name)
            # signal.alarm counts whole seconds; 0 would disable math-verify's own timeout.
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{path}.{name}={value!r} must be a whole number of seconds >= 1"
                )


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """The reward; both score 1.0 for a correct response and 0.0 otherwise."""

    name: str = "exact_match"
    """``exact_match`` (the synthetic arithmetic task) or ``math_verify`` (math answers)."""
    on_grader_failure: str = "zero_reward"
    """What a failed grading does: ``zero_reward`` (warn, reward 0) or ``raise``."""
    math_verify: MathVerifyConfig = field(default_factory=MathVerifyConfig)

    def validate(self, path: str = "rl.reward") -> None:
        check_choice(f"{path}.name", self.name, REWARDS)
        check_choice(f"{path}.on_grader_failure", self.on_grader_failure, FAILURE_POLICIES)
        validate_subsections(self, path)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Held-out evaluation: pass@1 and pass@k over ``samples`` samples, and greedy accuracy."""

    interval: int = 10
    """Evaluate every this many steps (and before and after training); 0: only then."""
    prompts: int = 200
    samples: int = 4
    """Samples per held-out prompt: pass@1 averages them, pass@k uses all k of them."""
    temperature: float = 1.0
    top_p: float = 1.0
    split: str = "test"
    """``test`` (eval.jsonl: what a run reports as held-out) or ``validation`` (valid.jsonl:
    for choosing settings without looking at the test problems)."""

    def validate(self, path: str = "rl.eval") -> None:
        check_choice(f"{path}.split", self.split, EVAL_SPLITS)
        check_positive(f"{path}.interval", self.interval, allow_zero=True)
        check_positive(f"{path}.prompts", self.prompts)
        check_positive(f"{path}.samples", self.samples)
        check_positive(f"{path}.temperature", self.temperature)
        check_fraction(f"{path}.top_p", self.top_p, closed="high")


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    """Reinforcement learning on prompt/answer data (``megatron-logra rl``)."""

    prompts_per_step: int = 16
    """Prompts in each step's global batch."""
    samples_per_prompt: int = 1
    """Responses per prompt (a GRPO group); the training batch is prompts x samples."""
    seed: int = 0
    """Seeds the prompt order and the sampling (counter-based: layout independent)."""
    updates_per_rollout: int = 1
    """Optimizer steps on each step's rollout batch (PPO/GRPO epochs), each over the whole
    batch. Above 1 the GRPO ratio is taken against the trainer's log-probs before the first
    update, so ``rl.loss.grpo.clip_low`` / ``clip_high`` act from the second update on (with one
    update the ratio is exactly 1). Needs ``rl.loss.name=grpo``."""
    logged_rollouts: int = 4
    """Responses of each step written to ``<run.dir>/rollouts.jsonl`` (the prompt as the model
    saw it, its ids, the response, reward, whether it ended with a stop token); 0: none."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    advantages: AdvantagesConfig = field(default_factory=AdvantagesConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def global_batch(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    def validate(self, path: str = "rl") -> None:
        check_positive(f"{path}.prompts_per_step", self.prompts_per_step)
        check_positive(f"{path}.samples_per_prompt", self.samples_per_prompt)
        check_positive(f"{path}.seed", self.seed, allow_zero=True)
        check_positive(f"{path}.updates_per_rollout", self.updates_per_rollout)
        check_positive(f"{path}.logged_rollouts", self.logged_rollouts, allow_zero=True)
        if self.updates_per_rollout > 1 and self.loss.name != "grpo":
            raise ValueError(
                f"{path}.updates_per_rollout={self.updates_per_rollout} takes several steps on "
                f"one rollout batch, which needs a ratio to the pre-update policy and its clip; "
                f"{path}.loss.name={self.loss.name!r} has none (its importance weight is "
                f"detached): set {path}.loss.name=grpo or {path}.updates_per_rollout=1"
            )
        validate_subsections(self, path)
        if self.loss.name == "grpo" and self.samples_per_prompt < 2:
            raise ValueError(
                f"{path}.loss.name=grpo normalises rewards within a prompt's responses; "
                f"{path}.samples_per_prompt={self.samples_per_prompt} must be >= 2"
            )
