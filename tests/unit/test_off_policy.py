"""Off-policy correction (``rl.loss.correction``): the importance weights of each correction
against hand-computed values, the presets' losses with them, and the settings that go with
``rollout.max_staleness``.

Ratios rho = pi_old / pi_rollout, mask [[1, 1, 1], [1, 1, 0]] (the last position is padding):

    rho        = [[1.5, 3.0, 0.25], [0.2, 0.6, -]]
    tis, C=2   = [[1.5, 2.0, 0.25], [0.2, 0.6, -]]  sum 4.55, 1 truncated (3.0)
    icepop     = [[1.5, 0,   0   ], [0,   0.6, -]]  band [0.5, 2.5]: sum 2.1, 3 outside
    seq_mask   = [[1.5, 2.0, 0.25], [0,   0,   -]]  geometric means (1.125)^(1/3) = 1.04 kept,
                                                    (0.12)^(1/2) = 0.35 masked: sum 3.75,
                                                    1 truncated + 2 masked
    none       = [[1,   1,   1   ], [1,   1,   -]]  sum 5
Raw ratio sum 5.55 and maximum 3.0 whatever the correction.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.config import CorrectionConfig, GrpoLossConfig, load_config
from megatron_logra.rl.losses import grpo_policy_loss, paper_policy_loss
from megatron_logra.rl.off_policy import importance_weights
from tests.torchrun import REPO

# Hand examples in float64 through exp(log(x)): ~1e-16 relative per operation.
FP64_TOL = 1e-12
RATIOS = [[1.5, 3.0, 0.25], [0.2, 0.6, 1.0]]
MASK = torch.tensor([[True, True, True], [True, True, False]])
BAND = {"mask_low": 0.5, "mask_high": 2.5}
EXPECTED = {
    "tis": ([[1.5, 2.0, 0.25], [0.2, 0.6, 0.0]], 1),
    "icepop": ([[1.5, 0.0, 0.0], [0.0, 0.6, 0.0]], 3),
    "seq_mask_tis": ([[1.5, 2.0, 0.25], [0.0, 0.0, 0.0]], 3),
    "none": ([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], 0),
}


def _logprobs() -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.tensor([[-0.5, -1.0, -2.0], [-0.25, -4.0, -math.inf]], dtype=torch.float64)
    rollout = old - torch.tensor(RATIOS, dtype=torch.float64).log()
    rollout[1, 2] = math.nan  # padding holds garbage: it must not reach a weight or a metric
    return old, rollout


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_correction_weighs_tokens_as_its_formula_says(name):
    old, rollout = _logprobs()
    weights, truncated = EXPECTED[name]
    result = importance_weights(old, rollout, MASK, CorrectionConfig(name=name, **BAND))
    torch.testing.assert_close(result.weight_BL, torch.tensor(weights, dtype=torch.float64),
                               rtol=0.0, atol=FP64_TOL)
    metrics = result.metrics
    assert metrics["importance_weight_sum"].item() == pytest.approx(sum(map(sum, weights)),
                                                                    abs=FP64_TOL)
    assert metrics["importance_ratio_sum"].item() == pytest.approx(5.55, abs=FP64_TOL)
    assert metrics["importance_ratio_max"].item() == pytest.approx(3.0, abs=FP64_TOL)
    assert metrics["truncated_count"].item() == truncated


def test_an_overflowing_ratio_is_truncated_or_masked_and_its_metrics_stay_finite():
    old = torch.tensor([[0.0, 0.0]])
    rollout = torch.tensor([[-200.0, 0.0]])  # rho = e^200: inf in fp32
    for name, weight in (("tis", 2.0), ("icepop", 0.0)):
        result = importance_weights(old, rollout, torch.ones(1, 2, dtype=torch.bool),
                                    CorrectionConfig(name=name))
        assert result.weight_BL[0, 0].item() == weight
        assert all(math.isfinite(v.item()) for v in result.metrics.values())


def test_an_unresolved_auto_correction_is_refused_by_the_loss():
    old, rollout = _logprobs()
    with pytest.raises(RuntimeError, match="correction.name=auto must be resolved"):
        importance_weights(old, rollout, MASK, CorrectionConfig())


def test_paper_loss_with_icepop_gives_each_token_minus_weight_times_advantage():
    old, rollout = _logprobs()
    logp = old.clone().requires_grad_(True)
    advantages = torch.tensor([2.0, -1.0], dtype=torch.float64)
    loss = paper_policy_loss(logp, rollout, advantages, MASK,
                             config=CorrectionConfig(name="icepop", **BAND))
    loss.loss_sum.backward()
    weights = torch.tensor(EXPECTED["icepop"][0], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, -weights * advantages[:, None], rtol=0.0,
                               atol=FP64_TOL)
    assert loss.metrics["truncated_count"].item() == 3


def test_grpo_correction_weighs_the_surrogate_and_not_the_reference_kl():
    """One update (ratio 1 to the trainer's own log-probs): d loss / d logp = -w A + beta (1 -
    e^(ref - logp)), with w the tis weight against the rollout's log-probs."""
    old, rollout = _logprobs()
    logp = old.clone().requires_grad_(True)
    reference = old + torch.tensor([[0.1, -0.2, 0.3], [0.0, 0.2, 0.0]], dtype=torch.float64)
    advantages = torch.tensor([2.0, -1.0], dtype=torch.float64)
    beta = 0.05
    loss = grpo_policy_loss(logp, old.clone(), advantages, MASK,
                            config=GrpoLossConfig(kl_beta=beta), reference_logprobs_BL=reference,
                            rollout_logprobs_BL=rollout, correction=CorrectionConfig(name="tis"))
    loss.loss_sum.backward()
    weights = torch.tensor(EXPECTED["tis"][0], dtype=torch.float64)
    kl_grad = beta * (1.0 - (reference - old).exp())
    expected = torch.where(MASK, -weights * advantages[:, None] + kl_grad, 0.0)
    torch.testing.assert_close(logp.grad, expected, rtol=0.0, atol=FP64_TOL)
    assert loss.metrics["importance_weight_sum"].item() == pytest.approx(4.55, abs=FP64_TOL)


# --------------------------------------------------------------------------- settings

RL_CONFIG = REPO / "configs" / "demo_rl_cpu.yaml"
SEPARATE = ["rollout.placement=separate", "parallel.tp=1"]


def _resolved(overrides: list[str]):
    return load_config(RL_CONFIG, overrides, command="rl").resolved(1, "rl")


@pytest.mark.parametrize(("overrides", "correction"), [
    (["rl.loss.name=paper", "parallel.tp=1"], "tis"),
    ([*SEPARATE, "rl.loss.name=paper", "rollout.max_staleness=1"], "tis"),
    (["rl.loss.name=grpo", "rl.samples_per_prompt=2", "parallel.tp=1"], "none"),
    ([*SEPARATE, "rl.loss.name=grpo", "rl.samples_per_prompt=2", "rollout.max_staleness=1"],
     "tis"),
    ([*SEPARATE, "rl.loss.name=grpo", "rl.samples_per_prompt=2", "rollout.max_staleness=1",
      "rl.loss.correction.name=icepop"], "icepop"),
])
def test_auto_correction_resolves_once_to_the_presets_weight_for_its_staleness(overrides,
                                                                             correction):
    assert _resolved(overrides).rl.loss.correction.name == correction


@pytest.mark.parametrize(("overrides", "fragments"), [
    (["rollout.max_staleness=1", "parallel.tp=1"],
     ["rollout.max_staleness=1 with rollout.placement=colocated", "rollout.placement=separate"]),
    ([*SEPARATE, "rollout.max_staleness=-1"], ["rollout.max_staleness=-1", ">= 0"]),
    ([*SEPARATE, "rollout.max_staleness=1", "rl.loss.correction.name=none"],
     ["rollout.max_staleness=1", "rl.loss.correction.name=none", "tis"]),
    (["rollout.cpus=[1]", "parallel.tp=1"], ["rollout.cpus=[1]", "rollout.placement=colocated"]),
    ([*SEPARATE, "rollout.cpus=[0,1]"], ["rollout.cpus=[0, 1]", "rollout.tp=1"]),
    (["rl.loss.paper.importance_weight_cap=3"], ["rl.loss.correction.tis_cap"]),
    (["rl.loss.correction.name=seq_mask_tis", "parallel.tp=1", "parallel.cp=2"],
     ["rl.loss.correction.name=seq_mask_tis", "parallel.cp=2"]),
    (["rl.loss.correction.tis_cap=0"], ["rl.loss.correction.tis_cap=0", "positive"]),
])
def test_async_and_correction_settings_that_cannot_act_are_refused_naming_them(overrides,
                                                                             fragments):
    with pytest.raises(ValueError) as info:
        _resolved(overrides)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
