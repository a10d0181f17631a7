"""The forward-mode logit probe and the vocab-parallel KL on real Megatron-Core GPTs over gloo.

Two torchrun jobs run ``workers/logit_jvp_worker.py``: one process (TP=1, the reference: finite
differences, fp32 vs fp64, training gradients, error paths; it saves its logits and tangents)
and two processes (TP=2 without and with sequence parallelism, compared with that reference).
Each test asserts one claim on the JSON they write. The worker's docstring describes the two
probe cases (LoGRA's frozen-target route, and every parameter carrying a tangent).

The streamed probe (one piece per row, the output layer chunk by chunk) is checked in the same
jobs: against finite differences and the whole-batch probe in fp64, and -- in the predicted-KL
step control over controlled training steps (``workers/kl_stream_steps.py``) -- alpha, the
predicted and the realised KL against the whole-batch computation it replaced, at TP=1, TP=2
with SP, PP=2, DP=2 and EP=2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.layouts import LOGIT_JVP_LAYOUTS as LAYOUTS
from tests.torchrun import WORKERS, run_torchrun

pytestmark = pytest.mark.distributed

WORKER = str(WORKERS / "logit_jvp_worker.py")
CASES = ("targets", "all_params")

# Central differences at eps = 1e-3 have truncation error O(eps^2) times the third derivative of
# the logits along a direction with |dz| ~ 2-5 |z|; measured 7e-6 and 1.1e-5.
FD_REL_TOL_AT_1E_3 = 1e-4
# O(eps^2): a 10x smaller step must give a 100x smaller error (measured 100.0 for both cases;
# fp64 roundoff at eps = 1e-4 is ~1e-12, far below the 7e-8 truncation error).
FD_ERROR_RATIO_BOUNDS = (90.0, 110.0)
# The same network in fp32 vs fp64: fp32 rounding (6e-8) through two layers; measured 1.4-2.3e-7.
FP32_VS_FP64_TANGENT_REL_TOL = 1e-5
# TP=2 differs from TP=1 only in the order of the sums split over ranks; measured 2-5e-16.
LAYOUT_REL_TOL_FP64 = 1e-13
# The same in fp32: different summation order in every TP-split matmul; measured 0.9-2.3e-7.
LAYOUT_REL_TOL_FP32 = 1e-5
# The predicted KL is a float64 average of per-token variances of those tangents: fp64 measured
# 1-2e-16; fp32 inputs measured 2e-9 to 4e-8 (a KL is quadratic in dz: twice dz's 2e-7, averaged).
PREDICTED_KL_LAYOUT_REL_TOL_FP64 = 1e-13
PREDICTED_KL_LAYOUT_REL_TOL_FP32 = 1e-6
# Vocab-parallel vs full-vocabulary forms: both float64, different summation order over the
# vocabulary; measured <= 2e-16.
VOCAB_PARALLEL_PREDICTED_KL_REL_TOL = 1e-13
# The exact KL of a small step is a difference of log-partition functions of size ~5 that
# cancels to ~1e-4, so a few ulps of those (1e-15) become ~1e-11 relative; measured 7e-13.
VOCAB_PARALLEL_EXACT_KL_REL_TOL = 1e-10
# The streamed probe computes the same logits and tangents as the whole-batch one from a row at a
# time and the output layer over fewer rows: matmul summation order only. fp64 measured
# ~1e-16, fp32 ~1e-7.
STREAMED_VS_WHOLE_REL_TOL_FP64 = 1e-13
STREAMED_VS_WHOLE_REL_TOL_FP32 = 1e-5
# The claim for the step control: alpha, the predicted and the realised KL of the
# streamed probe equal the whole-batch probe's to 1e-6 relative in fp32 (measured <= 2.4e-8:
# the float64 KL sums over fp32 logits that differ in summation order only).
STREAMED_STEP_CONTROL_REL_TOL = 1e-6
# What workers/kl_stream_steps.py runs: its layouts, steps, and probe responses (sequences 0-2 of
# a global batch of 4, so 2 + 1 over two DP or EP ranks).
STREAM_LAYOUT_NAMES = ("tp1", "tp2_sp", "pp2", "dp2", "ep2")
STREAM_STEPS = 3
STREAM_PROBE_RESPONSES = 3


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    out = Path(tmp_path_factory.mktemp("logit_jvp"))
    run_torchrun(1, [WORKER, "--case", "tp1", "--out", str(out)])
    return out


@pytest.fixture(scope="module")
def tp1(reference_dir) -> dict:
    return json.loads((reference_dir / "tp1.json").read_text())


@pytest.fixture(scope="module")
def tp2(reference_dir) -> dict:
    run_torchrun(2, [WORKER, "--case", "tp2", "--out", str(reference_dir)])
    return json.loads((reference_dir / "tp2.json").read_text())


def _layout_entries(tp2):
    """(layout, case, the worker's results) for every 2-process layout and case."""
    for layout in LAYOUTS:
        for case in CASES:
            yield layout, case, tp2["layouts"][layout][case]


def test_forward_ad_tangent_matches_central_differences_with_second_order_convergence(tp1):
    for case in CASES:
        entry = tp1["cases"][case]
        assert entry["fd_steps"] == [1e-3, 1e-4]
        coarse, fine = entry["fd_rel_err"]
        assert coarse < FD_REL_TOL_AT_1E_3, (case, entry)
        ratio = coarse / fine
        assert FD_ERROR_RATIO_BOUNDS[0] < ratio < FD_ERROR_RATIO_BOUNDS[1], (case, entry)


def test_float32_tangent_agrees_with_float64_tangent_of_the_same_weights(tp1):
    for case in CASES:
        entry = tp1["cases"][case]
        assert entry["fp32_vs_fp64_tangent_rel_err"] < FP32_VS_FP64_TANGENT_REL_TOL, (case, entry)


def test_probe_primal_logits_are_bit_identical_to_a_plain_forward(tp1, tp2):
    entries = [tp1["cases"][case] for case in CASES] + [
        entry for _, _, entry in _layout_entries(tp2)
    ]
    for entry in entries:
        assert entry["primal_identical_fp64"] and entry["primal_identical_fp32"], entry


def test_tp2_and_sequence_parallel_logits_and_tangent_equal_tp1(tp2):
    for layout, case, entry in _layout_entries(tp2):
        assert entry["sequence_parallel"] == (layout == "tp2_sp"), (layout, case)
        assert entry["logits_rel_err_fp64"] < LAYOUT_REL_TOL_FP64, (layout, case, entry)
        assert entry["tangent_rel_err_fp64"] < LAYOUT_REL_TOL_FP64, (layout, case, entry)
        assert entry["logits_rel_err_fp32"] < LAYOUT_REL_TOL_FP32, (layout, case, entry)
        assert entry["tangent_rel_err_fp32"] < LAYOUT_REL_TOL_FP32, (layout, case, entry)


def test_tp2_and_sequence_parallel_predicted_kl_equals_tp1(tp2):
    for layout, case, entry in _layout_entries(tp2):
        assert entry["predicted_kl_vs_tp1_rel_err_fp64"] < PREDICTED_KL_LAYOUT_REL_TOL_FP64, (
            layout, case, entry,
        )
        assert entry["predicted_kl_vs_tp1_rel_err_fp32"] < PREDICTED_KL_LAYOUT_REL_TOL_FP32, (
            layout, case, entry,
        )


def test_vocab_parallel_kl_equals_full_vocabulary_kl_of_gathered_logits(tp2):
    for layout, case, entry in _layout_entries(tp2):
        for tag in ("fp64", "fp32"):
            assert entry[f"counts_equal_{tag}"], (layout, case, entry)
            assert (
                entry[f"predicted_kl_parallel_vs_full_rel_err_{tag}"]
                < VOCAB_PARALLEL_PREDICTED_KL_REL_TOL
            ), (layout, case, entry)
            assert (
                entry[f"exact_kl_parallel_vs_full_rel_err_{tag}"]
                < VOCAB_PARALLEL_EXACT_KL_REL_TOL
            ), (layout, case, entry)


def test_token_sum_all_reduce_sums_total_and_count_over_the_group(tp2):
    for layout, case, entry in _layout_entries(tp2):
        for tag in ("fp64", "fp32"):
            assert entry[f"all_reduced_doubles_sum_and_count_{tag}"], (layout, case, entry)


def test_training_gradients_are_bit_identical_with_rules_installed_and_after_a_probe(tp1, tp2):
    for check in (tp1["gradients"], tp2["gradients_tp2_sp"]):
        assert check["num_grads"] > 0
        assert "LinearWithFrozenWeight" in check["patched_functions"]
        assert "_ReduceFromModelParallelRegion" in check["patched_functions"]
        assert check["identical_with_rules"], check
        assert check["identical_after_probe"], check
        assert check["parameters_restored"], check
        assert check["training_flags_restored"], check


def test_probe_rejects_malformed_input_and_a_lost_tangent(tp1):
    expected = {
        "unknown_layer": "ValueError: directions name layers that are not among the targets",
        "bad_shape": "ValueError: direction for decoder.layers.0.self_attention.linear_qkv",
        "target_as_parameter": "ValueError: parameter_tangents names the target weight",
        "nothing_to_probe": "ValueError: logit_jvp needs at least one direction",
        "two_chunks": "ValueError: without a pipeline there is exactly one model chunk",
        "tangent_lost": "RuntimeError: the logits carry no forward-mode tangent",
    }
    assert set(tp1["errors"]) == set(expected)
    for name, prefix in expected.items():
        assert tp1["errors"][name].startswith(prefix), (name, tp1["errors"][name])


def test_streamed_probe_tangent_matches_central_differences_with_second_order_convergence(tp1):
    entry = tp1["cases"]["targets"]
    coarse, fine = entry["streamed_fd_rel_err"]
    assert coarse < FD_REL_TOL_AT_1E_3, entry
    assert FD_ERROR_RATIO_BOUNDS[0] < coarse / fine < FD_ERROR_RATIO_BOUNDS[1], entry


def test_streamed_logits_and_tangent_equal_the_whole_batch_probe_at_counted_positions(tp1):
    entry = tp1["cases"]["targets"]
    for tag, bound in (("fp64", STREAMED_VS_WHOLE_REL_TOL_FP64),
                       ("fp32", STREAMED_VS_WHOLE_REL_TOL_FP32)):
        assert entry[f"streamed_logits_rel_err_{tag}"] < bound, entry
        assert entry[f"streamed_tangent_rel_err_{tag}"] < bound, entry


@pytest.fixture(scope="module")
def stream_steps(tp1, tp2) -> dict:
    return {**tp1["kl_stream"], **tp2["kl_stream"]}


@pytest.mark.parametrize("layout", STREAM_LAYOUT_NAMES)
def test_streamed_step_control_alpha_and_kl_equal_the_whole_batch_probe_over_steps(
        stream_steps, layout):
    steps = stream_steps[layout]["steps"]
    assert len(steps) == STREAM_STEPS
    for step in steps:
        assert step["alpha"] < 1.0, step  # the budget binds: alpha is the prediction at work
        for name in ("alpha", "predicted", "realised"):
            got, want = step[name], step[f"{name}_whole"]
            assert abs(got / want - 1) <= STREAMED_STEP_CONTROL_REL_TOL, (layout, name, step)


@pytest.mark.parametrize("layout", STREAM_LAYOUT_NAMES)
def test_streamed_probe_runs_each_response_at_its_real_length(stream_steps, layout):
    """One piece per probe response, cut after its last counted position: unpadded, except to
    an even length under sequence parallelism over 2 ranks, and -- with expert parallelism --
    an uncounted piece where the other rank of the expert group holds one more."""
    run = stream_steps[layout]
    real = run["real_lengths"][:STREAM_PROBE_RESPONSES]
    lengths = run["piece_lengths"]
    if layout == "tp2_sp":
        assert lengths[:STREAM_PROBE_RESPONSES] == [length + length % 2 for length in real]
    else:
        assert lengths[:STREAM_PROBE_RESPONSES] == real
    # The EP=2 ranks hold 2 and 1 probe responses: the second runs one more, uncounted, piece.
    assert lengths[STREAM_PROBE_RESPONSES:] == ([1] if layout == "ep2" else [0])
