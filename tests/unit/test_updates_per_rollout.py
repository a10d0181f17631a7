"""Several policy updates per rollout batch (issue 15 item 5) and the paper's mismatch rule.

* the GRPO preset takes its ratio against the pre-update log-probs it is given, so tokens whose
  ratio left ``[1 - clip_low, 1 + clip_high]`` in the favoured direction get no gradient and are
  counted; without them (one update per batch) the ratio is exactly 1 and nothing is clipped;
* ``rl.updates_per_rollout`` is refused where it cannot act (the paper loss has no ratio to the
  pre-update policy; supervised commands) and for counts below 1, naming the field; the LR
  schedule is as long as the run's optimizer steps;
* a batch without a completed, valid response leaves the mismatch EMA alone and the controller
  uses the unreduced budget (b_eff = b), as the paper's does; the next measured gap restores
  the subtraction.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.config import load_config
from megatron_logra.controller import KLController, KLControlSettings
from megatron_logra.rl.losses import GrpoLossConfig
from megatron_logra.rl.presets import GrpoPolicyLoss

# float64 through exp/log and a few products: ~1e-16 each; 1e-12 leaves a wide margin.
FP64_TOL = 1e-12
CLIP = 0.2
# Ratios to the pre-update policy: above 1 + clip, inside, below 1 - clip.
RATIOS = [1.5, 1.1, 0.5]


def _grpo_inputs(advantage: float):
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    logp = (old + torch.tensor(RATIOS, dtype=torch.float64).log()).requires_grad_(True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    return logp, old, torch.tensor([advantage], dtype=torch.float64), mask


@pytest.mark.parametrize(("advantage", "clipped_token"), [(2.0, 0), (-1.0, 2)])
def test_grpo_preset_with_pre_update_logprobs_gives_zero_gradient_on_clipped_tokens(
    advantage, clipped_token
):
    loss_fn = GrpoPolicyLoss(GrpoLossConfig(clip_low=CLIP, clip_high=CLIP))
    logp, old, advantages, mask = _grpo_inputs(advantage)
    loss, ratio_sum = loss_fn(logp, rollout_logprobs_BL=old, advantages_B=advantages,
                              response_mask_BL=mask, reference_logprobs_BL=None,
                              old_logprobs_BL=old)
    loss.loss_sum.backward()
    assert ratio_sum.item() == pytest.approx(sum(RATIOS), abs=FP64_TOL)
    # A > 0 clips r = 1.5 above 1.2; A < 0 clips r = 0.5 below 0.8: only that token.
    assert loss.metrics["clipped_count"].item() == 1
    grad = logp.grad[0]
    assert grad[clipped_token].item() == 0.0
    for token in range(3):
        if token != clipped_token:
            # d(-r A)/dlogp = -r A where the unclipped term is selected.
            assert grad[token].item() == pytest.approx(-RATIOS[token] * advantage, abs=FP64_TOL)


def test_grpo_preset_without_pre_update_logprobs_has_ratio_one_and_clips_nothing():
    loss_fn = GrpoPolicyLoss(GrpoLossConfig(clip_low=CLIP, clip_high=CLIP))
    logp, old, advantages, mask = _grpo_inputs(2.0)
    loss, ratio_sum = loss_fn(logp, rollout_logprobs_BL=old, advantages_B=advantages,
                              response_mask_BL=mask, reference_logprobs_BL=None)
    assert ratio_sum.item() == 3.0
    assert loss.metrics["clipped_count"].item() == 0


def test_updates_per_rollout_is_refused_with_the_paper_loss_and_below_one():
    with pytest.raises(ValueError, match=r"rl\.updates_per_rollout=2.*rl\.loss\.name=grpo"):
        load_config(None, ["rl.updates_per_rollout=2"], command="rl").validate()
    with pytest.raises(ValueError, match=r"rl\.updates_per_rollout=0"):
        load_config(None, ["rl.updates_per_rollout=0", "rl.loss.name=grpo",
                           "rl.samples_per_prompt=2"], command="rl").validate()
    cfg = load_config(None, ["rl.updates_per_rollout=3", "rl.loss.name=grpo",
                             "rl.samples_per_prompt=2", "train.steps=10"], command="rl")
    assert cfg.rl.updates_per_rollout == 3
    # The LR schedule runs over every optimizer step, not over the rollout steps.
    assert cfg.resolved(1, "rl").optimizer_steps == 30


def test_updates_per_rollout_is_refused_outside_rl_naming_it():
    cfg = load_config(None, ["rl.updates_per_rollout=2", "rl.loss.name=grpo",
                             "rl.samples_per_prompt=2"])
    with pytest.raises(ValueError, match=r"rl\.updates_per_rollout=2 is for rl"):
        cfg.resolved(1, "train")
    assert load_config(None, []).resolved(1, "train").optimizer_steps == cfg.train.steps


def test_a_batch_without_completed_responses_keeps_the_ema_and_uses_the_unreduced_budget():
    controller = KLController(KLControlSettings(schedule_steps=5))
    controller.observe_mismatch(1e-4)  # M = 3e-5
    measured = controller.decide(1e-5, completed_updates=2)
    # b(2) = 1.1e-4: with a measured gap b_eff = b - M = 8e-5.
    assert measured.kl_budget_effective == pytest.approx(8e-5, rel=FP64_TOL)
    assert controller.observe_mismatch(None) == pytest.approx(3e-5, rel=FP64_TOL)
    unmeasured = controller.decide(2e-5, completed_updates=2)
    assert unmeasured.kl_budget_effective == unmeasured.kl_budget
    assert unmeasured.mismatch == measured.mismatch
    # alpha = sqrt(b / m) = sqrt(1.1e-4 / 2e-5), below the cap of 3.
    assert unmeasured.alpha == pytest.approx(math.sqrt(5.5), rel=FP64_TOL)
    controller.observe_mismatch(1e-4)  # M = 0.7 * 3e-5 + 0.3 * 1e-4 = 5.1e-5
    again = controller.decide(1e-5, completed_updates=2)
    assert again.kl_budget_effective == pytest.approx(1.1e-4 - 5.1e-5, rel=FP64_TOL)
