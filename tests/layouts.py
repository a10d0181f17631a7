"""The parallel layouts the tests compare, and the named tolerances of those comparisons.

DESIGN section 6, rungs 3-4: a layout (TP, SP, PP, VPP, DP, the distributed optimizer) or a
resharded resume must not change a training run beyond the rounding of the arithmetic that
changed. Every bound on such a comparison of whole training runs is here, each with its reason
and what was measured, side by side (so one sees why RL's loss bound is ten times the supervised
one). A tolerance of one kernel's own measurement (finite differences, the sampler's log-probs)
stays in its test module, next to the siblings its reason refers to.

Error measures: ``max_entry_rel_err`` for the ``*_REL_TOL`` bounds on weights (relative to the
tensor's largest entry), ``norm_rel_err`` for the ``*_NORM_REL_TOL`` ones (per-tensor norm).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_logra.train.metrics import read_metrics
from tests.torchrun import run_torchrun

# ----------------------------------------------------------------------------- override sets

TP1 = ["parallel.tp=1"]
TP2 = ["parallel.tp=2"]
SP = ["parallel.sp=true"]
PP2 = ["parallel.pp=2"]
CP2 = ["parallel.cp=2"]
VPP2 = ["parallel.vpp=2"]
DISTOPT = ["optimizer.use_distributed_optimizer=true"]

Layout = tuple[int, list[str]]
"""(processes, overrides): DP is what TP x PP leave of the processes."""

# Every layout states its TP, so it means the same whatever the config file or base overrides say.
LAYOUTS: dict[str, Layout] = {
    "tp1": (1, TP1),
    "dp2": (2, TP1),
    "dp2_distopt": (2, [*TP1, *DISTOPT]),
    "tp2": (2, TP2),
    "tp2_sp": (2, [*TP2, *SP]),
    "tp2_dp2_sp": (4, [*TP2, *SP]),
    "tp2_dp2_sp_distopt": (4, [*TP2, *SP, *DISTOPT]),
    "pp2": (2, [*TP1, *PP2]),
    "pp2_vpp2": (2, [*TP1, *PP2, *VPP2]),
    "pp2_dp2_distopt": (4, [*TP1, *PP2, *DISTOPT]),
    "tp2_pp2": (4, [*TP2, *PP2]),
    "tp2_pp2_sp": (4, [*TP2, *PP2, *SP]),
    # Context parallelism: each sequence split over 2 ranks (4 chunks), with TP and with DP.
    "cp2": (2, [*TP1, *CP2]),
    "tp2_cp2_sp": (4, [*TP2, *CP2, *SP]),
    "dp2_cp2_distopt": (4, [*TP1, *CP2, *DISTOPT]),
}

# What each suite compares with its 1-process run.
KL_CONTROL_LAYOUTS = ("tp2_sp", "pp2", "pp2_vpp2", "dp2", "tp2_dp2_sp_distopt", "tp2_cp2_sp",
                      "dp2_cp2_distopt")
RL_LAYOUTS = ("tp2_sp", "dp2", "pp2", "cp2")
SGD_PARITY_LAYOUTS = ("tp1", "tp2_sp")
# The 2-process jobs of the rollout engine and of the logit probe run these one after another
# (workers/sampler_worker.py with LAYOUTS, workers/logit_jvp_worker.py with WORKER_LAYOUTS).
SAMPLER_LAYOUTS = ("tp2", "tp2_sp", "dp2", "pp2")
LOGIT_JVP_LAYOUTS = ("tp2", "tp2_sp")

# (processes, tp, sp) for the workers that take --tp/--sp (DP is processes / tp).
WORKER_LAYOUTS: dict[str, tuple[int, int, bool]] = {
    "tp1": (1, 1, False),
    "tp2": (2, 2, False),
    "tp2_sp": (2, 2, True),
    "tp2_dp2_sp": (4, 2, True),
}


def run_worker_at(layout: str, worker: Path, out: Path, *extra: str) -> None:
    """Run a worker script that takes ``--tp`` / ``--sp`` / ``--out`` at WORKER_LAYOUTS[layout]."""
    nproc, tp, sp = WORKER_LAYOUTS[layout]
    run_torchrun(nproc, [str(worker), *extra, "--tp", str(tp), "--out", str(out),
                         *(["--sp"] if sp else [])])


_worker_results: dict[tuple[str, str], dict] = {}


def worker_result(layout: str, worker: Path, tmp_path_factory) -> dict:
    """The ``result.json`` of :func:`run_worker_at`, the job launched once per test session."""
    key = (worker.name, layout)
    if key not in _worker_results:
        out = Path(tmp_path_factory.mktemp(f"{worker.stem}_{layout}"))
        run_worker_at(layout, worker, out)
        _worker_results[key] = json.loads((out / "result.json").read_text())
    return _worker_results[key]


def tp_sp(tp: int, sp: bool) -> list[str]:
    """The overrides of a worker's ``--tp`` / ``--sp``."""
    return [f"parallel.tp={tp}", f"parallel.sp={str(sp).lower()}"]


# ----------------------------------------------------------------------------- error measures


def max_entry_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def norm_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||."""
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- tolerances

# LoGRA training, e2e/test_layout_invariance.py.
# fp32 training where layouts differ only in reduction order (TP all-reduces, DP sums,
# microbatch accumulation). Measured over 6 steps: loss <= 1.3e-7 relative, weights <= 3.5e-6
# relative to each tensor's largest entry (RowAdam divides by per-row RMS, which amplifies the
# rounding of small rows slightly). The bounds leave ~5x headroom for other machines' BLAS.
LOGRA_LAYOUT_LOSS_REL_TOL = 1e-6
LOGRA_LAYOUT_WEIGHT_REL_TOL = 2e-5

# Dense Adam (Megatron's, distributed optimizer), distributed/test_context_parallel.py: Adam's
# first steps move every entry by ~lr * sign(g), so an entry whose gradient is at rounding level
# can move the other way at another layout. Measured over 3 steps at lr 0.01: largest entry
# 1.9e-4 of a tensor's largest for TP=2 vs TP=1 (no CP), 1.1e-4 for CP=2 vs CP=1; per-tensor
# norm 1.4e-5 and 5.9e-6. The norm bound leaves ~4x headroom over the TP figure.
DENSE_ADAM_LAYOUT_WEIGHT_NORM_REL_TOL = 5e-5

# Resharded resume, e2e/test_checkpoint.py.
# Resharding changes fp32 reduction order (TP all-reduces, pipeline stages): the layout
# invariance bounds of test_layout_invariance apply (measured here <= 2.1e-7 weights).
RESHARD_LOSS_REL_TOL = LOGRA_LAYOUT_LOSS_REL_TOL
RESHARD_WEIGHT_REL_TOL = LOGRA_LAYOUT_WEIGHT_REL_TOL
# bf16 runs at different TP/PP layouts: bf16 compute rounding (measured: loss 1.8e-5, weights
# 2.3e-3 per-tensor norm, ~0.6 bf16 ulp).
BF16_RESHARD_LOSS_REL_TOL = 1e-3
BF16_RESHARD_WEIGHT_NORM_REL_TOL = 1.5e-2

# Predicted-KL step control, e2e/test_kl_control.py.
# Layout comparisons: fp32 reduction-order noise. Measured: alpha <= 5.6e-7, predicted KL
# <= 1.1e-6 (a float64 sum over fp32 logits), realised KL <= 2.1e-6 (a small difference of
# nearby distributions, which amplifies fp32 noise), weights as in test_layout_invariance.
KL_CONTROL_LAYOUT_ALPHA_REL_TOL = 1e-5
KL_CONTROL_LAYOUT_KL_PREDICTED_REL_TOL = 1e-5
KL_CONTROL_LAYOUT_KL_REALISED_REL_TOL = 5e-5
KL_CONTROL_LAYOUT_WEIGHT_REL_TOL = LOGRA_LAYOUT_WEIGHT_REL_TOL

# RL post-training, e2e/test_rl.py.
# Layout comparisons: identical samples (counter-based sampling), fp32 reduction-order noise in
# the losses (measured <= 3e-7 relative).
RL_LAYOUT_LOSS_REL_TOL = 1e-5
# alpha = sqrt(b_eff / m) with b_eff = b - M: the mismatch EMA M is the rollout-vs-trainer
# log-prob gap, itself fp32 noise (~1e-7..1e-6) that differs between layouts. A change dM moves
# alpha by dM / (2 b_eff) relative: with b = 2e-3 and dM <= 1e-6 that is <= 2.5e-4 (measured
# 1.5e-5).
RL_LAYOUT_ALPHA_REL_TOL = 5e-4

# bf16 vs fp32, e2e/test_precision_modes.py (and e2e/test_moe.py): over 6 steps at lr 2e-3 bf16
# compute perturbs the loss by ~3e-4 relative (measured 2.6e-4) and the stored bf16 weights differ
# from fp32 by rounding, ~1.4 bf16 ulps in per-tensor norm (measured 5.5e-3). Bounds: loss 1e-3;
# weights 1.5e-2 (~4 ulps of 2^-8).
BF16_VS_FP32_LOSS_REL_TOL = 1e-3
BF16_VS_FP32_WEIGHT_NORM_REL_TOL = 1.5e-2

# dp_sharded masters, e2e/test_precision_modes.py.
# Sharded vs unsharded masters: the same fp32 arithmetic on the same rows; the DP=2 sketch sum
# of two partial sums is exact. Measured 0; allow fp32 rounding.
SHARDED_MASTERS_REL_TOL = 1e-6

# LoRA training, distributed/test_lora.py.
# fp32 Adam training where layouts differ only in reduction order. Measured over 4 steps:
# losses equal to 1e-7 relative, grad norms to 4e-8, adapters to 4.2e-6 of each tensor's largest
# entry (Adam's first steps are close to sign(g), which amplifies rounding of tiny gradient
# entries). About 5x headroom, as in the LoGRA layout-invariance tests.
LORA_LAYOUT_LOSS_REL_TOL = 1e-6
LORA_LAYOUT_GRAD_NORM_REL_TOL = 1e-6
LORA_LAYOUT_ADAPTER_REL_TOL = 2e-5


# The identity limit, e2e/test_identity_limit.py and e2e/test_moe.py: LoGRA with A = I and the
# SGD direction against Megatron's own SGD (clipping at 2.0, binding). Same arithmetic up to
# fp32 summation order (S = H^T X A^T with A = I, and the norm through the Gram matrix); measured
# <= 1e-7 relative on losses and norms, <= 1e-6 on weights (MoE: <= 2e-7 on the weights of the
# experts that always received tokens).
LOGRA_IDENTITY = [
    "optimizer.name=logra", "logra.distribution=identity", "logra.direction=sgd",
    "logra.native_optimizer=sgd",
]
SGD_PARITY_LOSS_REL_TOL = 1e-6
SGD_PARITY_GRAD_NORM_REL_TOL = 1e-5
SGD_PARITY_WEIGHT_REL_TOL = 1e-5
SGD_PARITY_CLIP = 2.0


def sgd_parity_weights(dense: Path, logra: Path, steps: int
                       ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Asserts the LoGRA run ``logra`` logged the losses and gradient norms of the SGD run
    ``dense`` (``steps`` records each, clipping binding at the first step, or clipping would be
    untested) and returns ``(LoGRA's, SGD's)`` full weights by name, the same names in both."""
    want, got = read_metrics(dense / "metrics.jsonl"), read_metrics(logra / "metrics.jsonl")
    assert len(got) == len(want) == steps
    assert want[0]["grad_norm"] > SGD_PARITY_CLIP
    for a, b in zip(got, want, strict=True):
        assert abs(a["loss"] - b["loss"]) <= SGD_PARITY_LOSS_REL_TOL * abs(b["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= (
            SGD_PARITY_GRAD_NORM_REL_TOL * b["grad_norm"]), (a, b)
    w_got, w_want = torch.load(logra / "full_weights.pt"), torch.load(dense / "full_weights.pt")
    assert sorted(w_got) == sorted(w_want)
    return w_got, w_want
