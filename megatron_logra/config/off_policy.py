"""The ``rl.loss.correction`` section: how the policy losses weight each sampled token against
the rollout engine's sampling log-probs (``megatron_logra.rl.off_policy`` has the formulas).

A rollout batch is sampled by the engine's copy of the policy, which differs from the trainer's
by numerics (always) and, with ``rollout.max_staleness`` > 0, by the updates made since the
batch's policy version. Both presets take the same correction; ``auto`` resolves once, for the
``rl`` command (``Config._derive_for_rl``): the paper's truncated weight for ``paper``; for
``grpo`` none on policy (its ratio is then exactly 1) and ``tis`` on stale batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_logra.config.checks import check_choice

CORRECTIONS: tuple[str, ...] = ("auto", "tis", "icepop", "seq_mask_tis", "none")
"""tis: per-token weight min(rho, tis_cap); icepop: rho inside [mask_low, mask_high], else 0;
seq_mask_tis: min(rho, tis_cap), and 0 for every token of a response whose geometric-mean rho
leaves [mask_low, mask_high]; none: weight 1."""


@dataclass(frozen=True, kw_only=True)
class CorrectionConfig:
    """Importance weights ``rho = pi_trainer / pi_rollout`` of the sampled tokens, corrected."""

    name: str = "auto"
    tis_cap: float = 2.0
    """C in ``min(rho, C)`` (tis, seq_mask_tis); the paper's truncated weight uses 2."""
    mask_low: float = 0.5
    """Lower end of the band a token's (icepop) or a response's geometric-mean (seq_mask_tis)
    ratio must fall in; 0.5 as IcePop."""
    mask_high: float = 5.0
    """Upper end of that band; 5 as IcePop."""

    def validate(self, path: str = "rl.loss.correction") -> None:
        check_choice(f"{path}.name", self.name, CORRECTIONS)
        for key in ("tis_cap", "mask_low", "mask_high"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"{path}.{key}={value!r} must be a positive number")
        if self.mask_low >= self.mask_high:
            raise ValueError(f"{path}.mask_low={self.mask_low} must be below "
                             f"{path}.mask_high={self.mask_high} (the band a ratio is kept in)")

    def resolved_name(self, loss_name: str, max_staleness: int) -> str:
        """The correction ``auto`` stands for with this preset and staleness."""
        if self.name != "auto":
            return self.name
        if loss_name == "paper":
            return "tis"
        return "tis" if max_staleness > 0 else "none"
