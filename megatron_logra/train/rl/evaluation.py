"""Held-out evaluation: pass@1 / pass@k (k = rl.eval.samples, unbiased estimator) and greedy
accuracy, with the per-problem answers behind them."""

from __future__ import annotations

from megatron_logra.config import RLConfig
from megatron_logra.data.prompt_data import PromptProblem
from megatron_logra.mcore import ParallelGroups
from megatron_logra.rl.eval_answers import EvalAnswer
from megatron_logra.rl.pass_at_k import mean_pass_at_k
from megatron_logra.rl.rewards import Reward
from megatron_logra.rl.rollout import RolloutBatch, RolloutEngine, data_parallel_share
from megatron_logra.train.rl.collectives import gather_dp
from megatron_logra.train.rl.prompts import PromptEncoder
from megatron_logra.train.rl.rollouts import sampling_params

# Fixed so every evaluation samples the same way: differences between evaluations are the model's.
EVAL_SEED = 2_000_003


def _score(rollout: RolloutBatch, problems: list[PromptProblem], encoder: PromptEncoder,
           reward: Reward, groups: ParallelGroups
           ) -> tuple[list[bool], list[tuple[str, int, bool]]]:
    """Correctness and (response text, tokens, ended with a stop token) of every problem,
    gathered over DP (global order)."""
    share = data_parallel_share(len(problems), groups.dp_rank, groups.dp_size)
    texts = encoder.response_texts(rollout)
    result = reward.score(texts, [problems[i].answer for i in share])
    responses = list(zip(texts, rollout.response_lengths.tolist(), rollout.finished.tolist(),
                         strict=True))
    gathered = gather_dp(list(zip(result.correct, responses, strict=True)), groups)
    return [bool(right) for right, _ in gathered], [response for _, response in gathered]


def evaluate(
    engine: RolloutEngine, encoder: PromptEncoder, reward: Reward,
    problems: list[PromptProblem], *, rl: RLConfig, groups: ParallelGroups,
) -> tuple[dict[str, float], list[EvalAnswer]]:
    """The metrics of one evaluation and its per-problem answers (the same on every rank)."""
    k, stop_ids = rl.eval.samples, encoder.stop_ids
    repeated = [problem for problem in problems for _ in range(k)]
    sampled, _ = _score(
        engine.generate(encoder.prompt_ids(repeated),
                        sampling_params(rl, stop_ids, evaluation=True), seed=EVAL_SEED),
        repeated, encoder, reward, groups,
    )
    greedy, greedy_texts = _score(
        engine.generate(encoder.prompt_ids(problems),
                        sampling_params(rl, stop_ids, evaluation=True, greedy=True),
                        seed=EVAL_SEED),
        problems, encoder, reward, groups,
    )
    per_problem = [sum(sampled[i * k : (i + 1) * k]) for i in range(len(problems))]
    metrics = {
        "eval_pass@1": mean_pass_at_k(k, per_problem, 1),
        "eval_pass@k": mean_pass_at_k(k, per_problem, k),
        "eval_k": k,
        "eval_greedy": sum(greedy) / len(greedy),
        # Greedy responses cut at rl.sampling.max_new_tokens (no stop token).
        "eval_truncated": sum(not finished for _, _, finished in greedy_texts) / len(greedy),
        "eval_problems": len(problems),
    }
    answers = [
        EvalAnswer(prompt=p.prompt, answer=p.answer, greedy=text, greedy_correct=bool(right),
                   samples_correct=int(n), greedy_tokens=int(length),
                   greedy_finished=bool(finished))
        for p, (text, length, finished), right, n in zip(problems, greedy_texts, greedy,
                                                        per_problem, strict=True)
    ]
    return metrics, answers
