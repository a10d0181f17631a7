"""The rollout phase of an RL step: sample this DP rank's share of the step's prompts, score it,
and compute the advantages of the whole global batch (identically on every rank).

Under context parallelism the engine's share is per DP x CP rank (the CP ranks of a replica
generate as extra data-parallel generators); the responses a replica trains on -- its data-
parallel share, the union of its CP ranks' -- are then gathered over its CP group."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_logra.config import RLConfig
from megatron_logra.data.prompt_data import PromptProblem
from megatron_logra.mcore import ParallelGroups
from megatron_logra.rl.presets import AdvantageEstimator
from megatron_logra.rl.rewards import FAILURE_STATUSES, Reward
from megatron_logra.rl.rollout import (
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    data_parallel_share,
)
from megatron_logra.train.rl.collectives import gather_cp, gather_dp
from megatron_logra.train.rl.prompts import PromptEncoder


@dataclass(frozen=True)
class ScoredRollouts:
    """One step's rollouts: this rank's responses, what every rank knows of the global batch.

    Attributes:
        share: global indices of this rank's responses.
        rollout: this rank's responses (with the engine's log-probs).
        rewards, correct, lengths: every response of the global batch, in global order.
        advantages: float32 ``[len(share)]``, this rank's slice of the global advantages.
        failed_grading: responses of the global batch whose grading failed (a grader timeout,
            a crashed or hung reward worker...): scored as incorrect by the reward's
            ``on_grader_failure=zero_reward``, counted here so the metrics show it.
    """

    share: range
    """Global indices of the responses this rank trains on (its DP replica's)."""
    rollout: RolloutBatch
    rewards: list[float]
    correct: list[bool]
    lengths: list[int]
    advantages: torch.Tensor
    failed_grading: int = 0


def sampling_params(rl: RLConfig, eos_id: int, *, evaluation: bool = False,
                    greedy: bool = False) -> SamplingParams:
    """Training rollouts sample with rl.sampling, evaluations with rl.eval; greedy decodes."""
    if greedy:
        temperature, top_p = 0.0, 1.0
    elif evaluation:
        temperature, top_p = rl.eval.temperature, rl.eval.top_p
    else:
        temperature, top_p = rl.sampling.temperature, rl.sampling.top_p
    return SamplingParams(max_new_tokens=rl.sampling.max_new_tokens, temperature=temperature,
                          top_p=top_p, eos_id=eos_id)


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of training step ``step`` (counter-based sampling: any layout)."""
    return (seed * 1_000_003 + step) % (2**62)


def collect_rollouts(
    engine: RolloutEngine,
    encoder: PromptEncoder,
    reward: Reward,
    advantages: AdvantageEstimator,
    problems: list[PromptProblem],
    *,
    rl: RLConfig,
    step: int,
    groups: ParallelGroups,
) -> ScoredRollouts:
    """Sample, score and compute advantages for step ``step``'s global prompt list."""
    rollout = engine.generate(encoder.prompt_ids(problems),
                              sampling_params(rl, encoder.eos_id),
                              seed=step_seed(rl.seed, step))
    share = data_parallel_share(len(problems), groups.dp_rank, groups.dp_size)
    scored = reward.score(encoder.response_texts(rollout), [problems[i].answer for i in share])
    all_correct = gather_dp(list(scored.correct), groups)
    all_rewards = gather_dp(list(scored.rewards), groups)
    all_lengths = gather_dp(rollout.response_lengths.tolist(), groups)
    failed = sum(gather_dp([sum(s in FAILURE_STATUSES for s in scored.status)], groups))
    bad = [i for i, value in enumerate(all_rewards) if not math.isfinite(value)]
    if bad:
        # Every rank holds the gathered rewards, so every rank refuses here, before the loss.
        raise RuntimeError(
            f"non-finite reward {all_rewards[bad[0]]} for response {bad[0]} of step {step + 1} "
            f"({len(bad)} of {len(all_rewards)}; check rl.reward); no weight was changed"
        )
    values = advantages.compute(rewards=all_rewards, correct=all_correct, lengths=all_lengths)
    if not bool(torch.isfinite(values).all()):
        raise RuntimeError(
            f"non-finite advantage at step {step + 1} (rewards all finite: the estimator's "
            "state is broken); no weight was changed"
        )
    if groups.cp_size > 1:
        share = data_parallel_share(len(problems), groups.data_rank, groups.data_size)
        rollout = RolloutBatch.merged(gather_cp(rollout, groups))
        if rollout.sequence_indices != tuple(share):
            raise RuntimeError(
                f"the CP group's responses {rollout.sequence_indices[:4]}... are not its "
                f"data-parallel share {share}: the engine's DP x CP shares do not tile it")
    return ScoredRollouts(
        share=share, rollout=rollout, rewards=all_rewards, correct=all_correct,
        lengths=all_lengths, advantages=values[share.start : share.stop],
        failed_grading=failed,
    )
