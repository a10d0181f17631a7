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
  (the last stage's copy of the embedding) == PP=1 tied.

Model initialisation is layout independent by construction, so the runs start from the same
full weights: the first-step loss is compared too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_logra.train.metrics import read_metrics
from tests.torchrun import REPO, run_torchrun

pytestmark = pytest.mark.distributed

CONFIG = REPO / "configs" / "demo_cpu.yaml"
STEPS = 6
BASE = [
    "parallel.device=cpu", "parallel.tp=1", "model.num_layers=4", "model.hidden_size=64",
    "model.num_attention_heads=4", "model.ffn_hidden_size=128", "model.seq_length=32",
    "model.activation=swiglu", "model.normalization=RMSNorm", "model.add_bias_linear=false",
    f"train.steps={STEPS}", "train.global_batch_size=8", "optimizer.name=logra",
    "optimizer.lr=0.01", "optimizer.lr_warmup_steps=0", "optimizer.clip_grad=1.0",
    "logra.sketch_rank=8", "run.save_full_weights=true",
]
# (processes, overrides) per layout; "reference" is TP=1, DP=1 with two microbatches of 4.
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "reference": (1, ["parallel.tp=1", "train.micro_batch_size=4"]),
    "one_microbatch": (1, ["parallel.tp=1", "train.micro_batch_size=8"]),
    "tp2": (2, ["parallel.tp=2", "train.micro_batch_size=4"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sp=true", "train.micro_batch_size=4"]),
    "dp2": (2, ["parallel.tp=1", "train.micro_batch_size=4"]),
    "dp2_distopt": (2, ["parallel.tp=1", "train.micro_batch_size=4",
                        "optimizer.use_distributed_optimizer=true"]),
    "tp2_dp2_sp_distopt": (4, ["parallel.tp=2", "parallel.sp=true", "train.micro_batch_size=4",
                               "optimizer.use_distributed_optimizer=true"]),
    "pp2": (2, ["parallel.pp=2", "train.micro_batch_size=4"]),
    "pp2_vpp2": (2, ["parallel.pp=2", "parallel.vpp=2", "train.micro_batch_size=4"]),
    "tp2_pp2_sp": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.sp=true",
                       "train.micro_batch_size=4"]),
    "pp2_dp2_distopt": (4, ["parallel.pp=2", "train.micro_batch_size=2",
                            "optimizer.use_distributed_optimizer=true"]),
    "tied": (1, ["model.untie_embeddings=false", "train.micro_batch_size=4"]),
    "tied_pp2": (2, ["model.untie_embeddings=false", "parallel.pp=2",
                     "train.micro_batch_size=4"]),
}
# fp32 training where layouts differ only in reduction order (TP all-reduces, DP sums,
# microbatch accumulation). Measured over 6 steps: loss <= 1.3e-7 relative, weights <= 3.5e-6
# relative to each tensor's largest entry (RowAdam divides by per-row RMS, which amplifies the
# rounding of small rows slightly). The bounds leave ~5x headroom for other machines' BLAS.
LOSS_REL_TOL = 1e-6
WEIGHT_REL_TOL = 2e-5

_runs: dict[str, Path] = {}


def _run(name: str, data_dir: Path, root: Path) -> Path:
    if name not in _runs:
        nproc, overrides = LAYOUTS[name]
        run_dir = root / name
        run_torchrun(nproc, ["-m", "megatron_logra", "train", str(CONFIG), *BASE, *overrides,
                             f"data.dir={data_dir}", f"run.dir={run_dir}"])
        _runs[name] = run_dir
    return _runs[name]


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("layouts")


def _compare(candidate: Path, reference: Path) -> tuple[float, float]:
    got, want = read_metrics(candidate / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert len(got) == len(want)
    loss_err = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(got, want, strict=True))
    w_got = torch.load(candidate / "full_weights.pt")
    w_want = torch.load(reference / "full_weights.pt")
    assert sorted(w_got) == sorted(w_want)
    weight_err = max(
        float((w_got[k] - w_want[k]).abs().max() / w_want[k].abs().max().clamp_min(1e-30))
        for k in w_want
    )
    return loss_err, weight_err


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
    ],
)
def test_logra_training_is_layout_invariant(candidate, reference, synthetic_data_dir, runs_root):
    loss_err, weight_err = _compare(
        _run(candidate, synthetic_data_dir, runs_root),
        _run(reference, synthetic_data_dir, runs_root),
    )
    assert loss_err < LOSS_REL_TOL, f"{candidate} vs {reference}: loss rel err {loss_err:.2e}"
    assert weight_err < WEIGHT_REL_TOL, f"{candidate} vs {reference}: weight err {weight_err:.2e}"


def test_reference_run_updates_every_step_and_lowers_the_loss(synthetic_data_dir, runs_root):
    """Guards the invariance tests against comparing runs that did nothing."""
    reference = _run("reference", synthetic_data_dir, runs_root)
    records = read_metrics(reference / "metrics.jsonl")
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert all(r["logra_update_count"] == r["step"] for r in records)
