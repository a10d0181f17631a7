"""RL post-training through the real CLI over gloo (issue [rl] item 8).

* a short run logs every per-step and evaluation field, with values in range, per-problem
  evaluation answers that agree with them, and plots;
* the samples, rewards, losses and the KL controller's decisions do not depend on the layout
  (TP=2 with SP, DP=2 and PP=2 against TP=1): sampling is counter based per global sequence;
* GRPO's reference KL is the k3 KL to the starting policy (0 at the first step, positive after
  it) and adds exactly kl_beta times itself to the loss (against the same run without it);
* resume == uninterrupted, running baseline and KL-controller state included;
* full activation recompute == none at PP=2, bit for bit (the sampler and the KL probe run in
  eval mode, where Megatron does not recompute; training gradients are bit-identical).
The model is randomly initialised (tiny, fast); learning itself is tested in test_rl_learning.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from megatron_logra.rl.eval_answers import eval_answers_path, read_eval_answers
from megatron_logra.train.metrics import read_metrics
from tests.cli_runs import CliRuns
from tests.layouts import LAYOUTS, RL_LAYOUT_ALPHA_REL_TOL, RL_LAYOUT_LOSS_REL_TOL, RL_LAYOUTS
from tests.presets import tiny_gpt
from tests.torchrun import REPO

pytestmark = pytest.mark.distributed

CONFIG = REPO / "configs" / "demo_rl_cpu.yaml"
STEPS = 3
BASE = [
    "parallel.tp=1", *tiny_gpt(), f"train.steps={STEPS}", "train.micro_batch_size=4",
    "rl.prompts_per_step=8", "rl.sampling.max_new_tokens=5", "rl.eval.interval=2", "rl.eval.prompts=8", "rl.eval.samples=2",
    "logra.kl_control.probe_responses=4", "logra.update_ratio=3e-2",
]
STEP_FIELDS = (
    "loss", "reward", "accuracy", "response_length", "grad_norm", "kl_predicted",
    "kl_predicted_scaled", "kl_realized", "alpha", "kl_budget", "kl_budget_effective",
    "mismatch", "importance_weight_mean", "logprob_gap_all_tokens", "logprob_gap_max", "tokens",
    "step_time_s", "tokens_per_s", "mem_bytes", "baseline", "kl_probe_time_s",
)
EVAL_FIELDS = ("eval_pass@1", "eval_pass@k", "eval_greedy")
# On-policy the sampler and the trainer compute the same log-probs up to fp32 rounding: the
# mismatch the controller measures, and its per-token maximum, must stay at that level
# (measured |mean gap| ~1e-7).
ON_POLICY_GAP_TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic_data_dir) -> CliRuns:
    return CliRuns(tmp_path_factory.mktemp("rl"), "rl", CONFIG, BASE, synthetic_data_dir)


# The TP=1 run saves after step 2: the resume test forks from it.
RESUME_AFTER = 2


def _layout_run(runs: CliRuns, layout: str) -> Path:
    if layout == "tp1":
        nproc, parallel = LAYOUTS[layout]
        return runs.run(layout, nproc, [*parallel, f"checkpoint.interval={RESUME_AFTER}"],
                        checkpointed=True)
    return runs.run(layout, *LAYOUTS[layout])


def test_rl_run_logs_every_metric_field_and_writes_plots(runs):
    run = _layout_run(runs, "tp2")
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for record in records[1:]:
        for field in STEP_FIELDS:
            value = record[field]
            assert isinstance(value, (int, float)) and math.isfinite(value), (field, value)
        assert 0.0 <= record["accuracy"] <= 1.0 and 1 <= record["response_length"] <= 5
        assert 0.0 < record["alpha"] <= 3.0 and record["kl_realized"] >= 0.0
        assert abs(record["logprob_gap_all_tokens"]) <= record["logprob_gap_max"] \
            < ON_POLICY_GAP_TOL
    evaluated = [r for r in records if "eval_pass@1" in r]
    assert [r["step"] for r in evaluated] == [0, 2, 3]
    for record in evaluated:
        for field in EVAL_FIELDS:
            assert 0.0 <= record[field] <= 1.0, (field, record[field])
        # pass@k over k samples is never below pass@1.
        assert record["eval_pass@k"] >= record["eval_pass@1"]
        # The per-problem answers file agrees with the aggregate metrics it stands behind.
        answers = read_eval_answers(eval_answers_path(run, record["step"]))
        assert len(answers) == record["eval_problems"] == 8
        assert sum(a.greedy_correct for a in answers) / len(answers) == record["eval_greedy"]
        solved = sum(a.samples_correct > 0 for a in answers) / len(answers)
        assert solved == record["eval_pass@k"]
    for name in ("reward.png", "eval.png", "kl.png", "alpha.png"):
        assert (run / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("layout", RL_LAYOUTS)
def test_rl_samples_rewards_and_updates_are_layout_invariant(layout, runs):
    reference_dir, candidate_dir = _layout_run(runs, "tp1"), _layout_run(runs, layout)
    reference = read_metrics(reference_dir / "metrics.jsonl")
    candidate = read_metrics(candidate_dir / "metrics.jsonl")
    assert len(candidate) == len(reference)
    for got, want in zip(candidate, reference, strict=True):
        for field in ("reward", "accuracy", "response_length", "tokens", *EVAL_FIELDS):
            assert got.get(field) == want.get(field), (layout, got["step"], field)
        if got["step"]:
            assert abs(got["loss"] - want["loss"]) <= RL_LAYOUT_LOSS_REL_TOL * abs(want["loss"])
            assert abs(got["alpha"] - want["alpha"]) <= RL_LAYOUT_ALPHA_REL_TOL * want["alpha"]
        if "eval_greedy" in want:
            # Gathered over DP in global problem order: the same answers, problem by problem.
            step = want["step"]
            assert read_eval_answers(eval_answers_path(candidate_dir, step)) == \
                read_eval_answers(eval_answers_path(reference_dir, step)), (layout, step)


# GRPO with and without a reference KL (library mode under the KL control), on the random
# start: the first steps' rewards are all 0 (no update) until a group has a correct response.
GRPO = ["rl.loss.name=grpo", "rl.samples_per_prompt=4", "rl.prompts_per_step=4",
        "logra.mode=library"]
KL_BETA = 1.0
# The loss is a float64 sum of fp32 per-token terms of size ~1 (ratio times advantage, plus
# beta times k3): adding beta * k3 in fp32 rounds by <= 2^-24 of a term, ~1e-7 on the mean.
# 1e-6 bounds it, 100x below beta times the reference KL after one update (~2e-4 here).
REFERENCE_KL_LOSS_TOL = 1e-6


def test_grpo_reference_kl_is_the_k3_kl_to_the_starting_policy_and_enters_the_loss_times_beta(
        runs):
    """The frozen reference is the starting policy. Until the policy first moves it is the
    reference: the k3 KL is 0 (to the recomputation's rounding) and so is its gradient, so the
    runs with and without the term take the same updates and sample the same rollouts, up to
    and including the first step after the first update. There the KL is positive and the loss
    with the reference term exceeds the loss without it by exactly kl_beta times that KL. One
    update per batch: the clipped ratio is exactly 1."""
    with_kl = [r for r in read_metrics(runs.run("grpo", 1, [*GRPO, f"rl.loss.grpo.kl_beta="
                                                            f"{KL_BETA}"]) / "metrics.jsonl")
               if r["step"] > 0]
    without = [r for r in read_metrics(runs.run("grpo_no_reference", 1, GRPO) / "metrics.jsonl")
               if r["step"] > 0]
    assert [r["step"] for r in with_kl] == [r["step"] for r in without] == [1, 2, 3]
    assert all(r["ratio_mean"] == 1.0 for r in with_kl)
    assert all("reference_kl" not in r for r in without)
    moved = next((i for i, r in enumerate(with_kl) if r["reference_kl"] > REFERENCE_KL_LOSS_TOL),
                 None)
    assert moved is not None and moved > 0, [r["reference_kl"] for r in with_kl]
    assert with_kl[moved]["reference_kl"] > 100 * REFERENCE_KL_LOSS_TOL
    for got, want in zip(with_kl[: moved + 1], without[: moved + 1], strict=True):
        assert (got["tokens"], got["reward"]) == (want["tokens"], want["reward"])
        excess = got["loss"] - want["loss"]
        assert abs(excess - KL_BETA * got["reference_kl"]) <= REFERENCE_KL_LOSS_TOL, (
            got["step"], excess, got["reference_kl"])


def test_rl_resume_equals_the_uninterrupted_run(runs):
    """Step 3 in a new job from the TP=1 run's own step-2 checkpoint (one job less than
    stopping a second run after step 2): the resumed job has nothing of the baseline or the
    controller but what the checkpoint holds, the state after step 2 however the job went on."""
    full = _layout_run(runs, "tp1")
    split = runs.forked("split", "tp1", RESUME_AFTER, LAYOUTS["tp1"])
    fields = ("loss", "reward", "baseline", "alpha", "mismatch", "kl_realized", *EVAL_FIELDS)
    want = [[r.get(f) for f in fields] for r in read_metrics(full / "metrics.jsonl")]
    got = [[r.get(f) for f in fields] for r in read_metrics(split / "metrics.jsonl")]
    assert got == want


def test_rl_with_full_recompute_equals_the_run_without_it_at_pp2(runs):
    nproc, parallel = LAYOUTS["pp2"]
    plain = _layout_run(runs, "pp2")
    recomputed = runs.run("pp2_recompute", nproc, [*parallel, "model.recompute=full"])
    fields = ("loss", "reward", "accuracy", "response_length", "grad_norm", "kl_predicted",
              "kl_realized", "alpha", "mismatch", "baseline", *EVAL_FIELDS)
    want = [[r.get(f) for f in fields] for r in read_metrics(plain / "metrics.jsonl")]
    got = [[r.get(f) for f in fields] for r in read_metrics(recomputed / "metrics.jsonl")]
    assert got == want
