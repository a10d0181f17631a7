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

from tests.cli_runs import CliRuns
from tests.layouts import (
    LAYOUTS,
    LOGRA_IDENTITY,
    SGD_PARITY_CLIP,
    SGD_PARITY_LAYOUTS,
    SGD_PARITY_WEIGHT_REL_TOL,
    max_entry_rel_err,
    sgd_parity_weights,
)
from tests.presets import tiny_gpt
from tests.torchrun import REPO

pytestmark = pytest.mark.distributed

CONFIG = REPO / "configs" / "demo_cpu.yaml"
BASE = [
    "parallel.device=cpu", *tiny_gpt(), "model.activation=swiglu", "model.add_bias_linear=true",
    "train.steps=5", "train.global_batch_size=8", "train.micro_batch_size=4", "optimizer.lr=0.2",
    "optimizer.lr_warmup_steps=0", "optimizer.sgd_momentum=0.0", "optimizer.weight_decay=0.01",
    # A clip threshold below the first steps' gradient norms, so clipping is exercised.
    f"optimizer.clip_grad={SGD_PARITY_CLIP}", "run.save_full_weights=true",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic_data_dir) -> CliRuns:
    return CliRuns(tmp_path_factory.mktemp("identity"), "train", CONFIG, BASE,
                   synthetic_data_dir)


@pytest.mark.parametrize("layout", SGD_PARITY_LAYOUTS)
def test_identity_projection_with_sgd_direction_reproduces_megatron_sgd(layout, runs):
    nproc, parallel = LAYOUTS[layout]
    dense = runs.run(f"sgd_{layout}", nproc, [*parallel, "optimizer.name=sgd"])
    logra = runs.run(f"logra_{layout}", nproc, [*parallel, *LOGRA_IDENTITY])
    w_got, w_want = sgd_parity_weights(dense, logra, steps=5)
    for name, tensor in w_want.items():
        err = max_entry_rel_err(w_got[name], tensor)
        assert err < SGD_PARITY_WEIGHT_REL_TOL, f"{name}: {err:.2e}"
