"""The predicted-KL step controller against hand-computed values."""

from __future__ import annotations

import math

import pytest

from megatron_logra.controller import (
    KLController,
    KLControlSettings,
    effective_budget,
    scheduled_budget,
    step_scale,
    updated_mismatch,
)

# Every expected value below is a few float64 operations (cos, sqrt, products) on numbers of
# order 1e-4; rounding is ~1e-16 relative, this leaves a wide margin.
REL_TOL = 1e-12


def test_default_settings_are_the_paper_values() -> None:
    s = KLControlSettings()
    assert (s.kl_budget, s.kl_budget_final, s.schedule_steps, s.alpha_max) == (2e-4, 2e-5, 300, 3.0)
    assert s.mismatch_subtraction is True
    assert (s.mismatch_ema_weight, s.mismatch_budget_floor) == (0.3, 0.5)
    # The paper probes 2 responses per data-parallel rank on 4 training GPUs; ours is a global
    # count (layout independent), 8 = 2 x 4.
    assert (s.probe_responses, s.probe_max_tokens) == (8, 4096)


def test_budget_starts_at_kl_budget_and_reaches_final_at_update_h_minus_one() -> None:
    s = KLControlSettings()
    assert scheduled_budget(s, 0) == pytest.approx(2e-4, rel=REL_TOL)
    assert scheduled_budget(s, 299) == pytest.approx(2e-5, rel=REL_TOL)


def test_budget_mid_schedule_values() -> None:
    # H = 5, k = 2: cos(pi/2) = 0, the mean of the endpoints.
    s = KLControlSettings(schedule_steps=5)
    assert scheduled_budget(s, 2) == pytest.approx(1.1e-4, rel=REL_TOL)
    # H = 4, k = 1: cos(pi/3) = 1/2, b = 2e-5 + 0.75 * 1.8e-4 = 1.55e-4.
    s = KLControlSettings(schedule_steps=4)
    assert scheduled_budget(s, 1) == pytest.approx(1.55e-4, rel=REL_TOL)


def test_budget_is_clamped_to_final_after_the_schedule() -> None:
    s = KLControlSettings()
    for k in (300, 301, 10_000):
        assert scheduled_budget(s, k) == pytest.approx(2e-5, rel=REL_TOL)


def test_negative_update_count_raises_value_error() -> None:
    with pytest.raises(ValueError, match="completed_updates"):
        scheduled_budget(KLControlSettings(), -1)


def test_mismatch_ema_over_three_observations() -> None:
    controller = KLController(KLControlSettings())
    # 0.7 * 0 + 0.3 * 1e-4
    assert controller.observe_mismatch(1e-4) == pytest.approx(3e-5, rel=REL_TOL)
    # a negative gap counts as 0: 0.7 * 3e-5
    assert controller.observe_mismatch(-5e-5) == pytest.approx(2.1e-5, rel=REL_TOL)
    # 0.7 * 2.1e-5 + 0.3 * 2e-4 = 1.47e-5 + 6e-5
    assert controller.observe_mismatch(2e-4) == pytest.approx(7.47e-5, rel=REL_TOL)


def test_non_finite_observed_mismatch_raises_runtime_error() -> None:
    for value in (math.nan, math.inf):
        with pytest.raises(RuntimeError, match="log-prob gap"):
            updated_mismatch(0.0, value, 0.3)


def test_effective_budget_subtracts_mismatch_down_to_the_floor() -> None:
    s = KLControlSettings()
    assert effective_budget(s, 2e-4, 5e-5) == pytest.approx(1.5e-4, rel=REL_TOL)
    # 2e-4 - 1.5e-4 = 5e-5 is below the floor 0.5 * 2e-4 = 1e-4.
    assert effective_budget(s, 2e-4, 1.5e-4) == pytest.approx(1e-4, rel=REL_TOL)
    off = KLControlSettings(mismatch_subtraction=False)
    assert effective_budget(off, 2e-4, 1.5e-4) == 2e-4


def test_alpha_is_sqrt_of_budget_over_predicted_kl() -> None:
    # sqrt(2e-4 / 5e-5) = 2
    assert step_scale(5e-5, 2e-4, 3.0) == pytest.approx(2.0, rel=REL_TOL)
    # sqrt(2e-4 / 8e-4) = 1/2: a step that is too large is shrunk.
    assert step_scale(8e-4, 2e-4, 3.0) == pytest.approx(0.5, rel=REL_TOL)


def test_alpha_is_capped_at_alpha_max() -> None:
    # sqrt(2e-4 / 1e-6) = 14.1 > 3
    assert step_scale(1e-6, 2e-4, 3.0) == 3.0


def test_zero_predicted_kl_gives_unit_alpha() -> None:
    assert step_scale(0.0, 2e-4, 3.0) == 1.0


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1e-12])
def test_nan_infinite_or_negative_predicted_kl_raises_runtime_error(value: float) -> None:
    with pytest.raises(RuntimeError, match="predicted KL"):
        step_scale(value, 2e-4, 3.0)
    with pytest.raises(RuntimeError, match="predicted KL"):
        KLController(KLControlSettings()).decide(value, completed_updates=0)


def test_decision_combines_schedule_mismatch_and_alpha() -> None:
    controller = KLController(KLControlSettings(schedule_steps=5))
    controller.observe_mismatch(1e-4)  # M = 3e-5
    decision = controller.decide(1e-5, completed_updates=2)
    # b(2) = 1.1e-4; b_eff = max(1.1e-4 - 3e-5, 5.5e-5) = 8e-5; alpha = sqrt(8) < 3
    assert decision.completed_updates == 2
    assert decision.kl_budget == pytest.approx(1.1e-4, rel=REL_TOL)
    assert decision.kl_budget_effective == pytest.approx(8e-5, rel=REL_TOL)
    assert decision.mismatch == pytest.approx(3e-5, rel=REL_TOL)
    assert decision.alpha == pytest.approx(math.sqrt(8.0), rel=REL_TOL)
    assert decision.kl_predicted == 1e-5
    assert decision.kl_predicted_scaled == pytest.approx(8e-5, rel=REL_TOL)
    assert set(decision.metrics()) == {
        "kl_predicted", "kl_predicted_scaled", "alpha", "kl_budget", "kl_budget_effective",
        "mismatch",
    }


def test_capped_decision_reports_the_scaled_prediction_below_budget() -> None:
    decision = KLController(KLControlSettings()).decide(1e-6, completed_updates=0)
    assert decision.alpha == 3.0
    assert decision.kl_predicted_scaled == pytest.approx(9e-6, rel=REL_TOL)


def test_state_dict_round_trip_and_update_count_going_back_raises() -> None:
    settings = KLControlSettings()
    controller = KLController(settings)
    controller.observe_mismatch(1e-4)
    controller.decide(1e-5, completed_updates=7)
    restored = KLController(settings)
    restored.load_state_dict(controller.state_dict())
    assert restored.mismatch == controller.mismatch
    assert restored.updates_seen == 7
    assert restored.decide(1e-5, completed_updates=7) == controller.decide(
        1e-5, completed_updates=7
    )
    with pytest.raises(RuntimeError, match="behind"):
        restored.decide(1e-5, completed_updates=6)


def test_load_state_dict_rejects_missing_or_corrupt_state() -> None:
    controller = KLController(KLControlSettings())
    with pytest.raises(RuntimeError, match="lacks"):
        controller.load_state_dict({"mismatch": 0.0})
    with pytest.raises(RuntimeError, match="corrupt"):
        controller.load_state_dict({"mismatch": math.nan, "updates_seen": 0})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kl_budget", 0.0), ("kl_budget", -1e-4), ("kl_budget", math.nan),
        ("kl_budget_final", 0.0), ("alpha_max", 0.0), ("alpha_max", math.inf),
        ("schedule_steps", 1), ("schedule_steps", 2.5), ("schedule_steps", True),
        ("mismatch_subtraction", 1), ("mismatch_ema_weight", 0.0),
        ("mismatch_ema_weight", 1.5), ("mismatch_budget_floor", 0.0),
        ("mismatch_budget_floor", 1.1), ("probe_responses", 0), ("probe_max_tokens", 0),
    ],
)
def test_invalid_settings_raise_value_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        KLControlSettings(**{field: value})
