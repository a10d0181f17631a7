"""The identity limit (DESIGN section 6, rung 2): LoGRA with A = I is Megatron's own SGD.

With ``logra.distribution=identity`` the projection is the identity (sketch rank = each layer's
input width), so the sketch *is* the dense gradient; with ``logra.direction=sgd`` the direction is
the sketch, and with ``logra.native_optimizer=sgd`` the other parameters use Megatron's SGD too.
The run must then reproduce ``optimizer.name=sgd`` (momentum 0): same losses, same global
gradient norms (the sketch norm is the reconstructed ``||S A|| = ||G||``), same clipping, same
weight decay, same weights -- at TP=1 and at TP=2 with sequence parallelism.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.train.metrics import read_metrics
from tests.cli_runs import CliRuns
from tests.layouts import LAYOUTS, SGD_PARITY_LAYOUTS, max_entry_rel_err
from tests.presets import tiny_gpt
from tests.torchrun import REPO

pytestmark = pytest.mark.distributed

CONFIG = REPO / "configs" / "demo_cpu.yaml"
BASE = [
    "parallel.device=cpu", *tiny_gpt(), "model.activation=swiglu", "model.add_bias_linear=true",
    "train.steps=5", "train.global_batch_size=8", "train.micro_batch_size=4", "optimizer.lr=0.2",
    "optimizer.lr_warmup_steps=0", "optimizer.sgd_momentum=0.0", "optimizer.weight_decay=0.01",
    # A clip threshold below the first steps' gradient norms, so clipping is exercised.
    "optimizer.clip_grad=2.0", "run.save_full_weights=true",
]
LOGRA_IDENTITY = [
    "optimizer.name=logra", "logra.distribution=identity", "logra.direction=sgd",
    "logra.native_optimizer=sgd",
]
# Same arithmetic up to fp32 summation order (S = H^T X A^T with A = I, and the norm through
# the Gram matrix); measured <= 1e-7 relative on losses and norms, <= 1e-6 on weights.
SGD_PARITY_LOSS_REL_TOL = 1e-6
SGD_PARITY_GRAD_NORM_REL_TOL = 1e-5
SGD_PARITY_WEIGHT_REL_TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic_data_dir) -> CliRuns:
    return CliRuns(tmp_path_factory.mktemp("identity"), "train", CONFIG, BASE,
                   synthetic_data_dir)


@pytest.mark.parametrize("layout", SGD_PARITY_LAYOUTS)
def test_identity_projection_with_sgd_direction_reproduces_megatron_sgd(layout, runs):
    nproc, parallel = LAYOUTS[layout]
    dense = runs.run(f"sgd_{layout}", nproc, [*parallel, "optimizer.name=sgd"])
    logra = runs.run(f"logra_{layout}", nproc, [*parallel, *LOGRA_IDENTITY])
    want, got = read_metrics(dense / "metrics.jsonl"), read_metrics(logra / "metrics.jsonl")
    assert len(got) == len(want) == 5
    # The clip threshold must actually bind in this comparison, or clipping is untested.
    assert want[0]["grad_norm"] > 2.0
    for a, b in zip(got, want, strict=True):
        assert abs(a["loss"] - b["loss"]) <= SGD_PARITY_LOSS_REL_TOL * abs(b["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= (
            SGD_PARITY_GRAD_NORM_REL_TOL * b["grad_norm"]), (a, b)
    w_got, w_want = torch.load(logra / "full_weights.pt"), torch.load(dense / "full_weights.pt")
    assert sorted(w_got) == sorted(w_want)
    for name, tensor in w_want.items():
        err = max_entry_rel_err(w_got[name], tensor)
        assert err < SGD_PARITY_WEIGHT_REL_TOL, f"{name}: {err:.2e}"
