"""The KL probe's forward-mode JVP through Megatron's MoE layer (issue 16 item 3), one process.

``workers/moe_jvp_worker.py`` probes an fp64 tiny MoE GPT (4 experts, top-2, every linear a
target, each routed expert's under its global index) along low-rank directions and compares the
tangent with central finite differences at two steps. Routing is piecewise constant: top-k's
selection has a zero tangent, so the JVP is the derivative *within* one routing piece; the worker
checks the differences stay inside it (same routing maps), and the rules of
``compat.moe_forward_ad`` carry the tangent through the router's gating linear.
"""

from __future__ import annotations

import json

import pytest

from tests.torchrun import WORKERS, run_torchrun

pytestmark = pytest.mark.distributed

# 2 decoder layers x 4 experts x (fc1, fc2).
EXPERT_TARGETS = 16
# Central differences have truncation error O(eps^2): measured 6.8e-8 at eps = 1e-4 (the dense
# worker measures 7e-6 at 1e-3, the same constant); fp64 roundoff at 1e-4 is ~1e-12.
FD_REL_TOL_AT_1E_4 = 1e-6
# O(eps^2): a 10x smaller step gives a 100x smaller error (measured 100.0).
FD_ERROR_RATIO_BOUNDS = (90.0, 110.0)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("moe_jvp")
    run_torchrun(1, [str(WORKERS / "moe_jvp_worker.py"), "--out", str(out)])
    return json.loads((out / "moe_jvp.json").read_text())


def test_moe_probe_covers_every_expert_and_leaves_the_logits_bit_identical(report):
    assert report["expert_targets"] == EXPERT_TARGETS
    assert report["logits_bit_identical"]
    assert report["tangent_norm"] > 0


def test_moe_logit_jvp_equals_finite_differences_within_one_routing_piece(report):
    coarse, fine = report["fd"]["0.0001"], report["fd"]["1e-05"]
    assert coarse["routing_unchanged"] and fine["routing_unchanged"]
    assert coarse["rel_err"] < FD_REL_TOL_AT_1E_4, coarse
    ratio = coarse["rel_err"] / fine["rel_err"]
    assert FD_ERROR_RATIO_BOUNDS[0] < ratio < FD_ERROR_RATIO_BOUNDS[1], ratio
