"""Predicted-KL step control through the real CLI (issue [kl-control] item 5).

Paper mode (the paper's RowAdam, a global update ratio, non-targets frozen) with the KL
controller, on the supervised corpus (the probe set is the first sequences of the global batch):

* alpha, the predicted KL and the applied update are the same at TP=2 with SP, PP=2, VPP, DP=2,
  TP=2 x DP=2, and with context parallelism at TP=2 x CP=2 and CP=2 x DP=2 as at TP=1;
* for small steps the realised KL after the update matches the prediction ``m * alpha^2``;
* when the proposed step is made 100x too large the controller still keeps the realised KL
  within the budget;
* the budget schedule and the mismatch subtraction follow the controller's arithmetic;
* a poisoned (NaN) sketch raises and leaves every weight untouched;
* the controller state survives a checkpoint: resume equals the uninterrupted run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megatron_logra.train.metrics import read_metrics
from tests.cli_runs import CliRuns
from tests.layouts import (
    DISTOPT,
    KL_CONTROL_LAYOUT_ALPHA_REL_TOL,
    KL_CONTROL_LAYOUT_KL_PREDICTED_REL_TOL,
    KL_CONTROL_LAYOUT_KL_REALISED_REL_TOL,
    KL_CONTROL_LAYOUT_WEIGHT_REL_TOL,
    KL_CONTROL_LAYOUTS,
    LAYOUTS,
    max_entry_rel_err,
)
from tests.presets import tiny_logra_run
from tests.torchrun import REPO, WORKERS, run_torchrun

pytestmark = pytest.mark.distributed

CONFIG = REPO / "configs" / "demo_cpu.yaml"
STEPS = 4
BASE = [
    *tiny_logra_run(STEPS), "train.micro_batch_size=4", "logra.mode=paper", "logra.kl_control.enabled=true",
    "logra.update_ratio=3e-2", "logra.kl_control.kl_budget=2e-4", "logra.kl_control.kl_budget_final=2e-4",
    # Probe sequences 0-5 of the global batch: split 4 + 2 over the two DP ranks at DP=2.
    "logra.kl_control.probe_responses=6",
    # fp32 factors for the layout comparisons (bf16 rounding of the factor can flip an ulp
    # between layouts); the bf16 default is exercised by the budget tests below.
    "logra.update_factor_dtype=fp32", "run.save_full_weights=true",
]
# The Fisher form is the KL's second-order term; at per-token KL ~2e-4 the third-order
# remainder is ~1% (measured 0.1-2%). 5% flags a broken prediction, not curvature.
PREDICTION_REL_TOL = 5e-2


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic_data_dir) -> CliRuns:
    return CliRuns(tmp_path_factory.mktemp("kl_control"), "train", CONFIG, BASE,
                   synthetic_data_dir)


def _reference(runs: CliRuns) -> Path:
    return runs.run("reference", *LAYOUTS["tp1"])


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("layout", KL_CONTROL_LAYOUTS)
def test_alpha_predicted_kl_and_update_are_layout_invariant(layout, runs):
    reference = _reference(runs)
    candidate = runs.run(layout, *LAYOUTS[layout])
    want, got = read_metrics(reference / "metrics.jsonl"), read_metrics(candidate / "metrics.jsonl")
    assert len(got) == len(want) == STEPS
    for a, b in zip(got, want, strict=True):
        assert _rel(a["alpha"], b["alpha"]) < KL_CONTROL_LAYOUT_ALPHA_REL_TOL, (
            a["step"], a["alpha"], b["alpha"])
        assert _rel(a["kl_predicted"], b["kl_predicted"]) < KL_CONTROL_LAYOUT_KL_PREDICTED_REL_TOL
        assert _rel(a["kl_realized"], b["kl_realized"]) < KL_CONTROL_LAYOUT_KL_REALISED_REL_TOL
    w_want, w_got = torch.load(reference / "full_weights.pt"), torch.load(candidate / "full_weights.pt")
    for key, tensor in w_want.items():
        err = max_entry_rel_err(w_got[key], tensor)
        assert err < KL_CONTROL_LAYOUT_WEIGHT_REL_TOL, (key, err)


def test_controller_is_active_and_realised_kl_matches_prediction(runs):
    records = read_metrics(_reference(runs) / "metrics.jsonl")
    for record in records:
        # The update ratio proposes more than the budget: alpha < 1 scales it down.
        assert record["alpha"] < 1.0
        assert record["kl_predicted_scaled"] == pytest.approx(record["kl_budget_effective"],
                                                              rel=1e-9)
        assert _rel(record["kl_realized"], record["kl_predicted_scaled"]) < PREDICTION_REL_TOL


def test_budget_holds_when_the_proposed_step_is_100x_too_large(runs):
    run = runs.run("too_large", 1, ["logra.update_ratio=3.0", "logra.update_factor_dtype=bf16"])
    for record in read_metrics(run / "metrics.jsonl"):
        assert record["alpha"] < 0.02  # the proposal is ~100x the budget's step
        assert record["kl_realized"] <= record["kl_budget_effective"] * (1 + PREDICTION_REL_TOL)


def test_budget_schedule_and_mismatch_follow_the_controller_arithmetic(runs):
    b0, b_final, horizon, gap, weight, floor = 4e-4, 1e-4, 4, 5e-5, 0.3, 0.5
    run = runs.run("schedule", 1, [
        f"logra.kl_control.kl_budget={b0}", f"logra.kl_control.kl_budget_final={b_final}",
        f"logra.kl_control.schedule_steps={horizon}", f"logra.kl_control.mismatch_input={gap}",
    ])
    mismatch = 0.0
    for k, record in enumerate(read_metrics(run / "metrics.jsonl")):
        mismatch = (1 - weight) * mismatch + weight * gap
        budget = b_final + 0.5 * (b0 - b_final) * (1 + math.cos(math.pi * min(k / (horizon - 1),
                                                                                1.0)))
        effective = max(budget - mismatch, floor * budget)
        assert record["kl_budget"] == pytest.approx(budget, rel=1e-12)
        assert record["mismatch"] == pytest.approx(mismatch, rel=1e-12)
        assert record["kl_budget_effective"] == pytest.approx(effective, rel=1e-12)
        assert record["alpha"] == pytest.approx(
            min(3.0, math.sqrt(effective / record["kl_predicted"])), rel=1e-12
        )


@pytest.mark.parametrize(("nproc", "mode"), [(1, "paper"), (2, "library")])
def test_poisoned_sketch_raises_and_leaves_every_weight_untouched(nproc, mode,
                                                                  synthetic_data_dir, tmp_path):
    run_torchrun(nproc, [str(WORKERS / "poisoned_sketch_worker.py"), "--data",
                         str(synthetic_data_dir), "--out", str(tmp_path), "--mode", mode])
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["error"] is not None and "non-finite LoGRA sketch" in result["error"]
    assert result["weights_unchanged"]
    assert result["update_count"] == 0
    assert not result["controller_consulted"]


def test_controller_state_survives_resume(runs):
    """Steps 3-4 in a new job from the uninterrupted run's own step-2 checkpoint (one job less
    than stopping a second run after step 2): the resumed job has nothing of the controller
    but what the checkpoint holds, which is the state after step 2 however the job went on."""
    extra = ["logra.kl_control.mismatch_input=3e-5", *DISTOPT]
    full = runs.run("resume_full", 2, [*extra, "checkpoint.interval=2"], checkpointed=True)
    split = runs.forked("resume_split", "resume_full", 2, (2, extra))
    want, got = read_metrics(full / "metrics.jsonl"), read_metrics(split / "metrics.jsonl")
    fields = ("loss", "alpha", "kl_predicted", "mismatch", "kl_budget_effective", "kl_realized")
    assert [[r[f] for f in fields] for r in got] == [[r[f] for f in fields] for r in want]
