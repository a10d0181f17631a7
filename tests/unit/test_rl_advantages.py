"""Advantage estimators against hand-computed values.

Paper preset, defaults (failure_reward -0.01, w = 0.1, L_ref = 1024), b starts at 0:

    batch 1: correct [T, F, T, F], lengths [2, 4, 8, 1024]
             o = [1, -0.01, 1, -0.01]           A = o - 0 = o
             A * 1024 / L = [512, -2.56, 128, -0.01]
             b <- 0.9 * 0 + 0.1 * mean(o) = 0.1 * 0.495 = 0.0495
    batch 2: correct [F, T], lengths [1024, 512]
             o = [-0.01, 1]                     A = o - 0.0495 = [-0.0595, 0.9505]
             A * 1024 / L = [-0.0595, 1.901]
             b <- 0.9 * 0.0495 + 0.1 * 0.495 = 0.09405

GRPO preset, group_size 4, Bessel-corrected std:

    [1, 0, 0, 1]: mean 1/2, std sqrt(1/3)   A = +-(1/2) / (sqrt(1/3) + eps)
    [0, 0, 0, 1]: mean 1/4, std 1/2         A = [-1/4, -1/4, -1/4, 3/4] / (1/2 + eps)
                  (the population std would be sqrt(3)/4, so this group tells the two apart)
    [0.3] * 4   : constant group            A = 0 exactly
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.rl.advantages import (
    GroupAdvantageConfig,
    PaperAdvantageConfig,
    RunningBaselineAdvantage,
    group_normalized_advantages,
)

# Advantages are computed in float64 and returned as float32: one rounding, relative 2^-24 ~ 6e-8.
FP32_REL_TOL = 2e-7
# The baseline is a float64 Python number after two fused updates: a few ulps of 2^-53.
BASELINE_ABS_TOL = 1e-15
EPS = 1e-6


def _assert_fp32_close(actual: torch.Tensor, expected: list[float]) -> None:
    assert actual.dtype == torch.float32
    expected_t = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.double(), expected_t, rtol=FP32_REL_TOL, atol=0.0)


def test_paper_advantages_and_baseline_match_hand_computed_values_over_two_batches():
    estimator = RunningBaselineAdvantage(PaperAdvantageConfig())
    assert estimator.baseline == 0.0
    first = estimator.compute([True, False, True, False], [2, 4, 8, 1024])
    _assert_fp32_close(first, [512.0, -2.56, 128.0, -0.01])
    assert estimator.baseline == pytest.approx(0.0495, abs=BASELINE_ABS_TOL)
    second = estimator.compute([False, True], [1024, 512])
    _assert_fp32_close(second, [-0.0595, 1.901])
    assert estimator.baseline == pytest.approx(0.09405, abs=BASELINE_ABS_TOL)
    assert estimator.num_updates == 2


def test_paper_advantages_use_only_previous_batches_baseline():
    # All-correct batch with b = 0: A = 1 for everyone, although b moves to 0.1 afterwards.
    estimator = RunningBaselineAdvantage(PaperAdvantageConfig(response_length_reference=None))
    advantages = estimator.compute([True, True], [3, 5])
    _assert_fp32_close(advantages, [1.0, 1.0])
    assert estimator.baseline == pytest.approx(0.1, abs=BASELINE_ABS_TOL)


def test_paper_advantages_without_length_weighting_are_outcome_minus_baseline():
    estimator = RunningBaselineAdvantage(PaperAdvantageConfig(response_length_reference=None))
    estimator.compute([True, False, True, False], [2, 4, 8, 1024])  # b -> 0.0495
    _assert_fp32_close(estimator.compute([False, True], [1024, 512]), [-0.0595, 0.9505])


def test_running_baseline_state_round_trip_resumes_identically():
    uninterrupted = RunningBaselineAdvantage(PaperAdvantageConfig())
    uninterrupted.compute([True, False, True, False], [2, 4, 8, 1024])
    saved = uninterrupted.state_dict()
    expected = uninterrupted.compute([False, True], [1024, 512])

    resumed = RunningBaselineAdvantage(PaperAdvantageConfig())
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved
    actual = resumed.compute([False, True], [1024, 512])
    assert torch.equal(actual, expected)
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_running_baseline_load_rejects_a_state_without_baseline():
    estimator = RunningBaselineAdvantage(PaperAdvantageConfig())
    with pytest.raises(ValueError, match="'baseline'"):
        estimator.load_state_dict({"num_updates": 3})


@pytest.mark.parametrize(
    ("lengths", "match"), [([0, 4], r"response_lengths\[0\]=0"), ([4], "response_lengths has 1")]
)
def test_paper_advantages_reject_bad_lengths(lengths, match):
    estimator = RunningBaselineAdvantage(PaperAdvantageConfig())
    with pytest.raises(ValueError, match=match):
        estimator.compute([True, False], lengths)
    assert estimator.num_updates == 0  # a rejected batch does not move the baseline


@pytest.mark.parametrize(
    ("field", "value"),
    [("running_baseline_weight", 0.0), ("running_baseline_weight", 1.5),
     ("response_length_reference", 0.0), ("failure_reward", math.nan)],
)
def test_paper_config_rejects_invalid_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RunningBaselineAdvantage(PaperAdvantageConfig(**{field: value}))


def test_group_advantages_match_hand_computed_values_with_unbiased_std():
    rewards = [1, 0, 0, 1, 0, 0, 0, 1, 0.3, 0.3, 0.3, 0.3]
    config = GroupAdvantageConfig(group_size=4, epsilon=EPS)
    advantages = group_normalized_advantages(rewards, config)
    half = 0.5 / (math.sqrt(1.0 / 3.0) + EPS)
    quarter = 0.25 / (0.5 + EPS)
    expected = [half, -half, -half, half, -quarter, -quarter, -quarter, 3 * quarter, 0, 0, 0, 0]
    _assert_fp32_close(advantages, expected)


def test_group_of_identical_rewards_has_exactly_zero_advantage():
    config = GroupAdvantageConfig(group_size=4)
    advantages = group_normalized_advantages([0.3] * 4 + [1.0] * 4, config)
    assert torch.equal(advantages, torch.zeros(8))


def test_group_advantages_reject_a_batch_that_is_not_whole_groups():
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_normalized_advantages([1.0, 0.0, 1.0], GroupAdvantageConfig(group_size=4))


def test_group_config_rejects_groups_of_one():
    with pytest.raises(ValueError, match="group_size=1"):
        group_normalized_advantages([1.0], GroupAdvantageConfig(group_size=1))
