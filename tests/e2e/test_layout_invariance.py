"""Layout invariance of LoGRA training through the real CLI (DESIGN section 6, rung 3).

Every run trains the same tiny GPT on the same global batches for a few steps with LoGRA (library
mode: RowAdam, clipping, native Adam for non-targets) and writes its per-step losses and its
final full (unsharded) weights. A parallel layout must not change the result beyond fp32
reduction-order noise:

* TP=2 == TP=1 (column shards own rows, row shards produce partial sketches summed over TP);
* SP on == off at TP=2 (the column-parallel input arrives sequence-sharded);
* DP=2 (half the batch each) == DP=1;
* 2 microbatches == 1;
* distributed optimizer on == off (DP=2);
* TP=2 x DP=2 with SP and the distributed optimizer, on 4 processes;
* PP=2 == PP=1 (1F1B), VPP (PP=2 x 2 virtual stages, interleaved) == PP=1, TP=2 x PP=2 with SP
  == TP=1 x PP=1, PP=2 with the distributed optimizer and DP=2, and PP=2 with tied embeddings
  (the last stage's copy of the embedding) == PP=1 tied;
* full activation recompute (block method) == none, at DP=2: bit for bit (the recomputed forward
  repeats the same operations; each sketch is accumulated once per microbatch);
* context parallelism: TP=2 x CP=2 with SP, and CP=2 x DP=2 with the distributed optimizer ==
  TP=1 (each sequence split in 4 chunks over the CP ranks); and the CP=2 x DP=2 run's step-3
  checkpoint resumed at CP=1 (TP=1, DP=1) finishes like the uninterrupted run.

Model initialisation is layout independent by construction, so the runs start from the same
full weights: the first-step loss is compared too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_logra.train.metrics import read_metrics
from tests.cli_runs import CliRuns, run_differences
from tests.layouts import (
    DISTOPT,
    LAYOUTS,
    LOGRA_LAYOUT_LOSS_REL_TOL,
    LOGRA_LAYOUT_WEIGHT_REL_TOL,
    RESHARD_LOSS_REL_TOL,
    RESHARD_WEIGHT_REL_TOL,
    max_entry_rel_err,
)
from tests.presets import tiny_logra_run
from tests.torchrun import REPO

pytestmark = pytest.mark.distributed

CONFIG = REPO / "configs" / "demo_cpu.yaml"
STEPS = 6
BASE = [
    *tiny_logra_run(STEPS), "optimizer.lr=0.01", "optimizer.lr_warmup_steps=0",
    "optimizer.clip_grad=1.0", "run.save_full_weights=true",
]
MICRO_BATCH_4 = "train.micro_batch_size=4"
CP_RESUME_AT = 3
TIED = "model.untie_embeddings=false"
# (layout, run overrides) per run; "reference" is TP=1, DP=1 with two microbatches of 4.
RUNS: dict[str, tuple[str, list[str]]] = {
    "reference": ("tp1", [MICRO_BATCH_4]),
    "one_microbatch": ("tp1", ["train.micro_batch_size=8"]),
    "tp2": ("tp2", [MICRO_BATCH_4]),
    "tp2_sp": ("tp2_sp", [MICRO_BATCH_4]),
    "dp2": ("dp2", [MICRO_BATCH_4]),
    "dp2_distopt": ("dp2_distopt", [MICRO_BATCH_4]),
    "tp2_dp2_sp_distopt": ("tp2_dp2_sp_distopt", [MICRO_BATCH_4]),
    "pp2": ("pp2", [MICRO_BATCH_4]),
    "pp2_vpp2": ("pp2_vpp2", [MICRO_BATCH_4]),
    "tp2_pp2_sp": ("tp2_pp2_sp", [MICRO_BATCH_4]),
    "pp2_dp2_distopt": ("pp2_dp2_distopt", ["train.micro_batch_size=2"]),
    "tied": ("tp1", [TIED, MICRO_BATCH_4]),
    "tied_pp2": ("pp2", [TIED, MICRO_BATCH_4]),
    "dp2_recompute": ("dp2", [MICRO_BATCH_4, "model.recompute=full",
                              "model.recompute_method=block", "model.recompute_num_layers=2"]),
    "tp2_cp2_sp": ("tp2_cp2_sp", [MICRO_BATCH_4]),
    "dp2_cp2_distopt": ("dp2_cp2_distopt", [MICRO_BATCH_4, f"checkpoint.interval={CP_RESUME_AT}"]),
}
CHECKPOINTED = {"dp2_cp2_distopt"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic_data_dir) -> CliRuns:
    return CliRuns(tmp_path_factory.mktemp("layouts"), "train", CONFIG, BASE, synthetic_data_dir)


def _run(runs: CliRuns, name: str) -> Path:
    layout, overrides = RUNS[name]
    nproc, parallel = LAYOUTS[layout]
    return runs.run(name, nproc, [*parallel, *overrides], checkpointed=name in CHECKPOINTED)


def _compare(candidate: Path, reference: Path) -> tuple[float, float]:
    got, want = read_metrics(candidate / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert len(got) == len(want)
    return run_differences(candidate, reference, max_entry_rel_err)


@pytest.mark.parametrize(
    ("candidate", "reference"),
    [
        ("tp2", "reference"),
        ("tp2_sp", "tp2"),
        ("dp2", "reference"),
        ("one_microbatch", "reference"),
        ("dp2_distopt", "dp2"),
        ("tp2_dp2_sp_distopt", "reference"),
        ("pp2", "reference"),
        ("pp2_vpp2", "reference"),
        ("tp2_pp2_sp", "reference"),
        ("pp2_dp2_distopt", "reference"),
        ("tied_pp2", "tied"),
        ("tp2_cp2_sp", "reference"),
        ("dp2_cp2_distopt", "reference"),
    ],
)
def test_logra_training_is_layout_invariant(candidate, reference, runs):
    loss_err, weight_err = _compare(_run(runs, candidate), _run(runs, reference))
    assert loss_err < LOGRA_LAYOUT_LOSS_REL_TOL, (
        f"{candidate} vs {reference}: loss rel err {loss_err:.2e}")
    assert weight_err < LOGRA_LAYOUT_WEIGHT_REL_TOL, (
        f"{candidate} vs {reference}: weight err {weight_err:.2e}")


def test_logra_training_with_full_recompute_equals_the_run_without_it(runs):
    loss_err, weight_err = _compare(_run(runs, "dp2_recompute"), _run(runs, "dp2"))
    assert (loss_err, weight_err) == (0.0, 0.0)


def test_context_parallel_checkpoint_resumed_at_cp1_matches_the_uninterrupted_run(runs):
    """Steps 4-6 at TP=1, CP=1, DP=1 from the CP=2 x DP=2 run's step-3 checkpoint (masters,
    row moments and the distributed Adam state resharded from 4 DP x CP ranks to 1)."""
    _run(runs, "dp2_cp2_distopt")
    resumed = runs.forked("cp2_resumed_at_cp1", "dp2_cp2_distopt", CP_RESUME_AT,
                          (1, [*LAYOUTS["tp1"][1], *DISTOPT, MICRO_BATCH_4]))
    loss_err, weight_err = _compare(resumed, _run(runs, "reference"))
    assert loss_err < RESHARD_LOSS_REL_TOL, loss_err
    assert weight_err < RESHARD_WEIGHT_REL_TOL, weight_err


def test_reference_run_updates_every_step_and_lowers_the_loss(runs):
    """Guards the invariance tests against comparing runs that did nothing."""
    reference = _run(runs, "reference")
    records = read_metrics(reference / "metrics.jsonl")
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert all(r["logra_update_count"] == r["step"] for r in records)
