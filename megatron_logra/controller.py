"""Predicted-KL step control: choose the scale of a proposed update from its predicted KL.

Given the predicted per-token KL ``m`` of the proposed update (the Fisher form, see
:mod:`megatron_logra.kl`), the controller scales the update by ``alpha`` so that the scaled
update's predicted KL, ``m * alpha**2`` (the KL is quadratic in the step), meets a per-token
budget:

* the budget follows a cosine from ``kl_budget`` to ``kl_budget_final``:
  ``b(k) = b_final + 1/2 (b_0 - b_final)(1 + cos(pi * min(k / (H - 1), 1)))`` with ``k`` the
  number of completed updates and ``H = schedule_steps`` (so ``b(0) = b_0`` and
  ``b(k) = b_final`` for ``k >= H - 1``);
* with ``mismatch_subtraction`` the measured rollout-vs-trainer log-prob gap, smoothed as
  ``M <- (1 - w) M + w max(mu_obs, 0)``, is taken out of the budget, but never more than a
  fraction: ``b_eff = max(b - M, floor * b)``;
* ``alpha = min(alpha_max, sqrt(b_eff / m))``; ``m == 0`` (the update does not move the policy)
  gives ``alpha = 1``; a NaN, infinite or negative ``m`` raises -- an update whose effect on the
  policy is unknown is never applied.

This is TRPO's closed-form step ``sqrt(2 delta / s^T F s)`` with ``m = 1/2 s^T F s``
(arXiv 1502.05477), with a cap, an annealed budget and the mismatch correction of LoGRA
(arXiv 2610.06647). Pure arithmetic on Python floats; nothing here communicates.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


def _require(condition: bool, field: str, value: Any, rule: str) -> None:
    if not condition:
        raise ValueError(f"{field}={value!r} {rule}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class KLControlSettings:
    """Settings of the predicted-KL step controller (defaults: the LoGRA paper's).

    Attributes:
        kl_budget: per-token KL budget at the first update (nats).
        kl_budget_final: per-token budget from update ``schedule_steps - 1`` on.
        schedule_steps: H, the number of updates the cosine spans (at least 2).
        alpha_max: cap on the step scale.
        mismatch_subtraction: subtract the smoothed rollout/trainer mismatch from the budget.
        mismatch_ema_weight: w, weight of a new mismatch observation in the EMA.
        mismatch_budget_floor: the subtraction never leaves less than this fraction of the
            scheduled budget.
        probe_responses: responses of the *global* batch, evenly spaced through it (wherever
            they live: :mod:`megatron_logra.probe_selection`), on which the KL is predicted and
            measured. The paper takes 2 per data-parallel rank; a global count keeps alpha
            independent of the data-parallel size (8 = the paper's 2 per rank on its 4 training
            GPUs), and spacing them out spreads the probe's work over the ranks.
        probe_max_tokens: at most this many of each probe response's generated positions are
            probed (its prompt runs before them as context, uncounted).
    """

    kl_budget: float = 2e-4
    kl_budget_final: float = 2e-5
    schedule_steps: int = 300
    alpha_max: float = 3.0
    mismatch_subtraction: bool = True
    mismatch_ema_weight: float = 0.3
    mismatch_budget_floor: float = 0.5
    probe_responses: int = 8
    probe_max_tokens: int = 4096

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("kl_budget", "kl_budget_final", "alpha_max"):
            value = getattr(self, name)
            _require(
                _is_number(value) and math.isfinite(value) and value > 0,
                name, value, "must be a finite number > 0",
            )
        _require(
            _is_int(self.schedule_steps) and self.schedule_steps >= 2,
            "schedule_steps", self.schedule_steps,
            "must be an integer >= 2 (the cosine runs over updates 0 .. H-1); for a constant "
            "budget set kl_budget_final equal to kl_budget",
        )
        _require(
            isinstance(self.mismatch_subtraction, bool),
            "mismatch_subtraction", self.mismatch_subtraction, "must be true or false",
        )
        _require(
            _is_number(self.mismatch_ema_weight)
            and 0.0 < self.mismatch_ema_weight <= 1.0,
            "mismatch_ema_weight", self.mismatch_ema_weight,
            "must be in (0, 1] (1 uses only the latest observation)",
        )
        _require(
            _is_number(self.mismatch_budget_floor)
            and 0.0 < self.mismatch_budget_floor <= 1.0,
            "mismatch_budget_floor", self.mismatch_budget_floor,
            "must be in (0, 1] (the fraction of the budget the mismatch can never take away)",
        )
        for name in ("probe_responses", "probe_max_tokens"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, name, value, "must be an integer >= 1")


def scheduled_budget(settings: KLControlSettings, completed_updates: int) -> float:
    """``b(k)``: the cosine budget after ``completed_updates`` updates."""
    if completed_updates < 0:
        raise ValueError(f"completed_updates={completed_updates} must be >= 0")
    progress = min(completed_updates / (settings.schedule_steps - 1), 1.0)
    b0, b_final = settings.kl_budget, settings.kl_budget_final
    return b_final + 0.5 * (b0 - b_final) * (1.0 + math.cos(math.pi * progress))


def updated_mismatch(previous: float, observed: float, weight: float) -> float:
    """``(1 - w) M + w max(mu_obs, 0)``: a negative observed gap counts as no mismatch."""
    if not math.isfinite(observed):
        raise RuntimeError(
            f"observed rollout/trainer log-prob gap is {observed}; the log-probs are broken"
        )
    return (1.0 - weight) * previous + weight * max(observed, 0.0)


def effective_budget(settings: KLControlSettings, budget: float, mismatch: float) -> float:
    """``max(b - M, floor * b)`` with mismatch subtraction on, else ``b``."""
    if not settings.mismatch_subtraction:
        return budget
    return max(budget - mismatch, settings.mismatch_budget_floor * budget)


def step_scale(predicted_kl: float, budget: float, alpha_max: float) -> float:
    """``min(alpha_max, sqrt(budget / m))``; 1 when ``m == 0``; RuntimeError unless ``m`` is a
    finite number >= 0."""
    if not (math.isfinite(predicted_kl) and predicted_kl >= 0.0):
        raise RuntimeError(
            f"predicted KL is {predicted_kl!r}; refusing an update whose effect on the policy is "
            "unknown (check the probe's logits and tangents for non-finite values)"
        )
    if predicted_kl == 0.0:
        return 1.0
    return min(alpha_max, math.sqrt(budget / predicted_kl))


@dataclass(frozen=True)
class KLDecision:
    """What the controller decided for one update (log every field).

    Attributes:
        completed_updates: k, the number of updates applied before this one.
        kl_predicted: m, predicted per-token KL of the proposed (unscaled) update.
        kl_predicted_scaled: ``m * alpha**2``, predicted KL of the update as applied.
        alpha: the step scale.
        kl_budget: the scheduled budget b(k).
        kl_budget_effective: the budget after mismatch subtraction.
        mismatch: the mismatch EMA M used.
    """

    completed_updates: int
    kl_predicted: float
    kl_predicted_scaled: float
    alpha: float
    kl_budget: float
    kl_budget_effective: float
    mismatch: float

    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items() if k != "completed_updates"}


class KLController:
    """The controller's state across updates: the mismatch EMA and the last update count seen.

    Per update: :meth:`observe_mismatch` (the step's measured gap, or None when it has no
    completed, valid response to measure), then :meth:`decide` with the predicted KL and the optimizer's count of completed updates.
    """

    def __init__(self, settings: KLControlSettings) -> None:
        self.settings = settings
        self.mismatch = 0.0
        self.updates_seen = 0
        # Whether the latest observation measured a gap: a batch without completed, valid
        # responses measures none, and the paper's controller then uses the unreduced budget
        # (b_eff = b) while its EMA stays as it was.
        self.mismatch_measured = True

    def observe_mismatch(self, observed_gap: float | None) -> float:
        """Fold one measured gap ``mean(log pi_rollout - log pi_trainer)`` into the EMA; None
        (nothing to measure this batch) leaves the EMA alone and makes :meth:`decide` use the
        unreduced budget until the next measured gap."""
        if observed_gap is None:
            self.mismatch_measured = False
            return self.mismatch
        self.mismatch = updated_mismatch(
            self.mismatch, observed_gap, self.settings.mismatch_ema_weight
        )
        self.mismatch_measured = True
        return self.mismatch

    def decide(self, predicted_kl: float, *, completed_updates: int) -> KLDecision:
        """The step scale for the update that follows ``completed_updates`` updates."""
        if completed_updates < self.updates_seen:
            raise RuntimeError(
                f"completed_updates={completed_updates} is behind the {self.updates_seen} this "
                "controller has already seen; restore its state_dict together with the "
                "optimizer's"
            )
        budget = scheduled_budget(self.settings, completed_updates)
        budget_eff = (effective_budget(self.settings, budget, self.mismatch)
                      if self.mismatch_measured else budget)
        alpha = step_scale(predicted_kl, budget_eff, self.settings.alpha_max)
        self.updates_seen = completed_updates
        return KLDecision(
            completed_updates=completed_updates,
            kl_predicted=predicted_kl,
            kl_predicted_scaled=predicted_kl * alpha * alpha,
            alpha=alpha,
            kl_budget=budget,
            kl_budget_effective=budget_eff,
            mismatch=self.mismatch,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"mismatch": self.mismatch, "updates_seen": self.updates_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"mismatch", "updates_seen"} - set(state)
        if missing:
            raise RuntimeError(f"KL controller state lacks {sorted(missing)}; got {sorted(state)}")
        mismatch, updates_seen = float(state["mismatch"]), int(state["updates_seen"])
        if not (math.isfinite(mismatch) and mismatch >= 0.0) or updates_seen < 0:
            raise RuntimeError(
                f"KL controller state is corrupt: mismatch={mismatch}, updates_seen={updates_seen}"
            )
        self.mismatch, self.updates_seen = mismatch, updates_seen
