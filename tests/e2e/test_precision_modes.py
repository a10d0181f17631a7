"""Target-weight precision modes through the real CLI (issue [pipeline] item 2).

* ``model.params_dtype=bf16`` uses Megatron's mixed precision (Float16Module, fp32 main grads) and
  LoGRA's ``dp_sharded`` masters: fp32 master rows and row moments for a 1/dp share of every
  target's rows, the sketch reduce-scattered, the updated bf16 rows all-gathered.
* Sharding the masters is exact: DP=2 sharded equals DP=1 (where one rank owns every row).
* bf16 with sharded masters tracks the fp32 run to bf16 tolerance, also at TP=2 x DP=2 with SP
  and the distributed optimizer for the non-targets.
* The per-rank persistent state is what the design predicts: bf16 weights (2 B) and a 1/dp
  share of the fp32 masters and row moments (4 B per target parameter and per target row).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.cli_runs import CliRuns, run_differences
from tests.layouts import (
    BF16_VS_FP32_LOSS_REL_TOL,
    BF16_VS_FP32_WEIGHT_NORM_REL_TOL,
    DISTOPT,
    SHARDED_MASTERS_REL_TOL,
    SP,
    TP2,
    norm_rel_err,
)
from tests.presets import SWIGLU_RMSNORM_NO_BIAS, tiny_gpt
from tests.torchrun import REPO

pytestmark = pytest.mark.distributed

CONFIG = REPO / "configs" / "demo_cpu.yaml"
BASE = [
    "parallel.device=cpu", "parallel.tp=1", *tiny_gpt(), *SWIGLU_RMSNORM_NO_BIAS,
    "train.steps=6", "train.global_batch_size=8", "train.micro_batch_size=4",
    "optimizer.name=logra", "optimizer.lr=0.002", "optimizer.lr_warmup_steps=0",
    "logra.sketch_rank=16", "run.save_full_weights=true",
]
BF16 = "model.params_dtype=bf16"
RUNS = {
    "fp32_dp2": (2, []),
    "bf16_dp1": (1, [BF16]),
    "bf16_dp2": (2, [BF16]),
    "fp32_tp2_dp2": (4, [*TP2, *SP]),
    "bf16_tp2_dp2": (4, [BF16, *TP2, *SP, *DISTOPT]),
}
TARGET_SUFFIXES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
                   "linear_fc2.weight")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic_data_dir) -> CliRuns:
    return CliRuns(tmp_path_factory.mktemp("precision"), "train", CONFIG, BASE,
                   synthetic_data_dir)


def _run(runs: CliRuns, name: str) -> Path:
    return runs.run(name, *RUNS[name])


def _differences(candidate: Path, reference: Path) -> tuple[float, float]:
    return run_differences(candidate, reference, norm_rel_err)


def test_dp_sharded_masters_equal_unsharded_masters(runs):
    loss, weights = _differences(_run(runs, "bf16_dp2"), _run(runs, "bf16_dp1"))
    assert loss <= SHARDED_MASTERS_REL_TOL and weights <= SHARDED_MASTERS_REL_TOL, (loss, weights)


@pytest.mark.parametrize(("candidate", "reference"),
                         [("bf16_dp2", "fp32_dp2"), ("bf16_tp2_dp2", "fp32_tp2_dp2")])
def test_bf16_with_sharded_masters_tracks_fp32_to_bf16_tolerance(candidate, reference, runs):
    loss, weights = _differences(_run(runs, candidate), _run(runs, reference))
    assert loss <= BF16_VS_FP32_LOSS_REL_TOL, loss
    assert weights <= BF16_VS_FP32_WEIGHT_NORM_REL_TOL, weights


def _per_rank_state_bytes(run: Path) -> list[dict]:
    return json.loads((run / "state_bytes.json").read_text())["per_rank"]


def test_sharded_masters_hold_a_one_over_dp_share_per_rank(runs):
    dp1 = _per_rank_state_bytes(_run(runs, "bf16_dp1"))[0]
    dp2_runs = _per_rank_state_bytes(_run(runs, "bf16_dp2"))
    fp32 = _per_rank_state_bytes(_run(runs, "fp32_dp2"))[0]
    weights = torch.load(_run(runs, "bf16_dp1") / "full_weights.pt")
    targets = [t for name, t in weights.items() if name.endswith(TARGET_SUFFIXES)]
    target_params = sum(t.numel() for t in targets)
    target_rows = sum(t.shape[0] for t in targets)
    # Every parameter is bf16 (2 B) instead of fp32 (4 B), and so is the one copy of each
    # projection the optimizer holds.
    assert all(rank["weights"] * 2 == fp32["weights"] for rank in dp2_runs)
    assert all(rank["projections"] * 2 == fp32["projections"] for rank in dp2_runs)
    # DP=1 keeps fp32 masters (4 B/param) and row moments (4 B/row) for every target row; each
    # of the two DP=2 ranks keeps exactly half of them. Nothing else differs.
    saved = 4 * target_params // 2 + 4 * target_rows // 2
    for rank in dp2_runs:
        assert dp1["optimizer_state"] - rank["optimizer_state"] == saved
        assert rank["sketches"] == dp1["sketches"] and rank["grads"] == dp1["grads"]
