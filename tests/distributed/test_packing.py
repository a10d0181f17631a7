"""Packed sequences are exact against the padded path (issue [packing] item 3; DESIGN section 6,
rung 3: packed == padded).

Three torchrun jobs of ``workers/packing_worker.py`` (its docstring says what each measures):
one process (float64 sketches, pack neighbours, forward-mode AD, for ``sdpa`` and ``local``
attention), two processes (RL runs packed and padded at TP=2 with SP, DP=2 -- also the GRPO
preset with a reference model and two updates per rollout batch, and bf16 -- PP=2 and CP=2,
the last also in LoGRA's library mode) and four processes (TP=2 x DP=2 with SP, and CP=2 x DP=2
with the distributed optimizer; a float64 packed row at TP=2 x CP=2 with SP); the two-process job also runs ``sft`` on prompt data packed and
padded under the interleaved pipeline schedule (PP=2, VPP=2) and under CP=2.

Context parallelism (issue [cp] item 3): a packed row's every sequence is split into ``2 cp``
chunks; packed CP=2 is compared with padded CP=2 like every layout, and with the packed and the
padded runs of a CP=1 layout of the same job (DP=2; TP=2 x DP=2 with SP) on the same rollouts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.layouts import (
    BF16_RESHARD_LOSS_REL_TOL,
    BF16_RESHARD_WEIGHT_NORM_REL_TOL,
    KL_CONTROL_LAYOUT_ALPHA_REL_TOL,
    KL_CONTROL_LAYOUT_KL_PREDICTED_REL_TOL,
    KL_CONTROL_LAYOUT_KL_REALISED_REL_TOL,
    LOGRA_LAYOUT_LOSS_REL_TOL,
    LOGRA_LAYOUT_WEIGHT_REL_TOL,
)
from tests.torchrun import WORKERS, run_torchrun

pytestmark = pytest.mark.distributed

WORKER = str(WORKERS / "packing_worker.py")

# float64: the packed row and the padded microbatches differ only in the order of float64 sums
# (measured 1.4e-16 to 2.5e-16 for the sketch, 2e-16 to 5e-16 for logits and tangents).
FLOAT64_REL_TOL = 1e-12
# The bound, fp32: per-token log-probs of the same rollouts on the same model (measured
# <= 1.1e-7), and at every step the loss (a sum in another order; measured <= 1.2e-7), alpha
# and the predicted KL (measured <= 2.6e-7 and 5.1e-7 over three steps: the weights differ by
# the previous steps' rounding only, <= 7e-6 of the largest entry).
PACKED_REL_TOL = 1e-6
# On-policy the rollout/trainer gap is fp32 rounding (as in test_rl.py: measured ~1e-7).
ON_POLICY_GAP_TOL = 1e-5


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    out = Path(tmp_path_factory.mktemp("packing_single"))
    run_torchrun(1, [WORKER, "--case", "single", "--out", str(out)])
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def two(tmp_path_factory, synthetic_data_dir) -> dict:
    out = Path(tmp_path_factory.mktemp("packing_two"))
    run_torchrun(2, [WORKER, "--case", "rl", "--out", str(out), "--data",
                     str(synthetic_data_dir), "--layouts", "tp2_sp,dp2,pp2,cp2", "--grpo", "dp2",
                     "--bf16", "dp2", "--library", "cp2", "--sft", "pp2_vpp2,cp2", "--cp1", "dp2"])
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def four(tmp_path_factory, synthetic_data_dir) -> dict:
    out = Path(tmp_path_factory.mktemp("packing_four"))
    run_torchrun(4, [WORKER, "--case", "rl", "--out", str(out), "--data",
                     str(synthetic_data_dir), "--layouts", "tp2_dp2_sp,dp2_cp2_distopt",
                     "--cp-fp64", "tp2_cp2_sp"])
    return json.loads((out / "result.json").read_text())


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_float64_sketch_of_a_packed_row_equals_the_sum_of_the_padded_microbatches(single,
                                                                                   attention):
    assert single[attention]["sketch_rel_err"] <= FLOAT64_REL_TOL


@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_a_sequences_losses_do_not_depend_on_its_pack_neighbours(single, attention):
    # Same sequence, other neighbours, another offset in the row: bit for bit the same here.
    assert single[attention]["neighbours_rel_err"] == 0.0


@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_forward_mode_tangent_of_a_packed_row_equals_each_sequences_unpacked_jvp(single,
                                                                                 attention):
    assert single[attention]["tangent_rel_err"] <= FLOAT64_REL_TOL
    assert single[attention]["primal_rel_err"] <= FLOAT64_REL_TOL


def _runs(report: dict):
    for layout, runs in report.items():
        if layout in ("padded_layout_changes", "cp_vs_cp1", "cp_fp64"):
            continue
        for preset, run in runs.items():
            yield f"{layout}:{preset}", run


def _fp32_rl_runs(two: dict, four: dict):
    return [(name, run) for report in (two, four) for name, run in _runs(report)
            if not name.endswith((":bf16", ":sft"))]


def test_every_layout_and_preset_ran_packed_and_padded_with_the_step_fields(two, four):
    names = sorted(name for report in (two, four) for name, _ in _runs(report))
    assert names == ["cp2:library", "cp2:paper", "cp2:sft", "dp2:bf16", "dp2:grpo", "dp2:paper",
                     "dp2_cp2_distopt:paper", "pp2:paper", "pp2_vpp2:sft", "tp2_dp2_sp:paper",
                     "tp2_sp:paper"]
    for _, run in _runs(two):
        for packed, padded in zip(run["packed"], run["padded"], strict=True):
            # Packing runs fewer tokens in more, smaller microbatches here (a 40-token budget
            # against 4 x 32 padded); both report what they ran.
            assert packed["processed_tokens"] < padded["processed_tokens"]
            assert 0.0 <= packed["padding_fraction"] < padded["padding_fraction"] < 1.0
            assert packed["microbatches"] > padded["microbatches"] >= 1


def test_per_token_logprobs_of_the_same_rollouts_agree_packed_and_padded(two, four):
    for name, run in _fp32_rl_runs(two, four):
        logprobs = run["logprobs"]
        assert logprobs["old_logprobs_tokens"] > 0, name
        assert logprobs["old_logprobs_rel_err"] <= PACKED_REL_TOL, (name, logprobs)
        if name.endswith(":grpo"):  # the reference model's pass too
            assert logprobs["reference_logprobs_rel_err"] <= PACKED_REL_TOL, (name, logprobs)


def test_losses_alpha_and_predicted_kl_agree_at_every_step(two, four):
    for name, run in _fp32_rl_runs(two, four):
        for step, (packed, padded) in enumerate(zip(run["packed"], run["padded"],
                                                    strict=True)):
            assert 0.0 < padded["alpha"] < 3.0, (name, step)  # below its cap: it acts
            for key in ("loss", "alpha", "kl_predicted"):
                assert _rel(packed[key], padded[key]) <= PACKED_REL_TOL, (name, step, key)
            assert abs(packed["rollout_trainer_gap"] or 0.0) <= ON_POLICY_GAP_TOL, (name, step)


def test_realised_kl_and_weights_stay_within_the_layout_tolerances(two, four):
    """The realised KL is a difference of two nearby distributions (the suite's reason for its
    layout bound; measured <= 4.5e-6 here); the weights are compared as across layouts."""
    for name, run in _fp32_rl_runs(two, four):
        for step, (packed, padded) in enumerate(zip(run["packed"], run["padded"],
                                                    strict=True)):
            assert _rel(packed["kl_realized"], padded["kl_realized"]) <= (
                KL_CONTROL_LAYOUT_KL_REALISED_REL_TOL), (name, step)
        for when in ("weights_first_step", "weights_last_step"):
            assert run[when]["max_entry_rel_err"] <= LOGRA_LAYOUT_WEIGHT_REL_TOL, (name, when)


def test_bf16_packed_and_padded_agree_within_the_bf16_layout_bounds(two):
    run = two["dp2"]["bf16"]
    for packed, padded in zip(run["packed"], run["padded"], strict=True):
        assert _rel(packed["loss"], padded["loss"]) <= BF16_RESHARD_LOSS_REL_TOL
    assert run["weights_last_step"]["norm_rel_err"] <= BF16_RESHARD_WEIGHT_NORM_REL_TOL


@pytest.mark.parametrize("layout", ["pp2_vpp2", "cp2"])
def test_sft_on_prompt_data_is_exact_packed_under_the_interleaved_schedule_and_cp(two, layout):
    run = two[layout]["sft"]
    for step, (packed, padded) in enumerate(zip(run["packed"], run["padded"], strict=True)):
        if layout == "pp2_vpp2":
            # The interleaved schedule needs a multiple of PP microbatches per rank.
            assert packed["microbatches"] % 2 == 0, step
        assert packed["padding_fraction"] < padded["padding_fraction"]
        for key in ("loss", "alpha", "kl_predicted"):
            assert _rel(packed[key], padded[key]) <= PACKED_REL_TOL, (step, key)
    assert run["weights_last_step"]["max_entry_rel_err"] <= LOGRA_LAYOUT_WEIGHT_REL_TOL


def test_float64_packed_row_split_over_cp_equals_its_sequences_alone_without_cp(two, four):
    """Logits, their forward-mode tangent and the LoGRA sketch (summed over the CP ranks) of a
    packed row of five sequences split per sequence over CP=2 (and CP=2 x DP=2, TP=2 x CP=2
    with SP), against each sequence alone on one rank: the order of float64 sums only
    (measured <= 5.1e-16)."""
    measured = {**two["cp_fp64"], **four["cp_fp64"]}
    assert sorted(measured) == ["cp2", "dp2_cp2_distopt", "tp2_cp2_sp"]
    for layout, errors in measured.items():
        for key in ("primal_rel_err", "tangent_rel_err", "sketch_rel_err"):
            assert errors[key] <= FLOAT64_REL_TOL, (layout, key, errors)


def test_packed_cp2_runs_equal_packed_and_padded_cp1_runs_on_the_same_rollouts(two, four):
    """Packed CP=2 == packed CP=1 == padded CP=1, a change of layout: at every step the loss,
    alpha and the predicted and realised KL, and the weights after the last step, within the
    suite's layout bounds (measured CP=2 vs DP=2: loss <= 4e-8, alpha <= 6.2e-8, predicted KL
    <= 1.3e-7, realised KL <= 1.9e-6, weights <= 1.7e-6)."""
    compared = sorted(name for report in (two, four) for name in report["cp_vs_cp1"])
    assert compared == ["cp2_vs_dp2:paper", "dp2_cp2_distopt_vs_tp2_dp2_sp:paper"]
    bounds = {"loss": LOGRA_LAYOUT_LOSS_REL_TOL, "alpha": KL_CONTROL_LAYOUT_ALPHA_REL_TOL,
              "kl_predicted": KL_CONTROL_LAYOUT_KL_PREDICTED_REL_TOL,
              "kl_realized": KL_CONTROL_LAYOUT_KL_REALISED_REL_TOL}
    for report in (two, four):
        for name, against in report["cp_vs_cp1"].items():
            for batching, errors in against.items():
                for key, bound in bounds.items():
                    assert errors[f"{key}_rel_err"] <= bound, (name, batching, key, errors)
                assert errors["max_entry_rel_err"] <= LOGRA_LAYOUT_WEIGHT_REL_TOL, (name, batching)
