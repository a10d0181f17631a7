"""Per-token policy losses against hand-computed values and their closed-form gradients.

Paper preset, cap 2, advantages A = [2, -1], mask [[1, 1, 1], [1, 1, 0]], logp_old = logp:

    logp       = [[-0.5, -1.0, -2.0], [-0.25, -4.0, -inf(pad)]]
    raw w      = [[ 1.5,  3.0,  0.5], [ 1.0,   1.0,  -      ]]   (rollout = logp - log(raw w))
    w          = [[ 1.5,  2.0,  0.5], [ 1.0,   1.0,  -      ]]   (3.0 truncated to the cap)
    loss_t     = -w A logp = [[1.5, 4, 2], [-0.25, -4, -]]       sum = 3.25 over 5 tokens
    dL/dlogp   = -w A      = [[-3, -4, -1], [1, 1, 0]]           (w is a constant)

GRPO preset, clip 0.2 both sides, ratios r = [1.5, 0.5, 1.1] in each row, A = [2, -1]:

    A = +2: r=1.5 -> min(3.0, 2.4) = 2.4 clipped, grad 0;  r=0.5 -> min(1.0, 1.6) = 1.0, grad -1.0;
            r=1.1 -> 2.2 (inside), grad -2.2
    A = -1: r=1.5 -> min(-1.5, -1.2) = -1.5, grad 1.5;      r=0.5 -> min(-0.5, -0.8) = -0.8
            clipped, grad 0;  r=1.1 -> -1.1, grad 1.1
    loss = -(2.4 + 1.0 + 2.2 - 1.5 - 0.8 - 1.1) = -2.2, clipped tokens 2, ratio sum 6.2
    (d/dlogp of -r A is -r A because dr/dlogp = r.)

k3 reference KL with d = ref - logp: k3 = e^d - d - 1, d k3 / d logp = 1 - e^d.
    d = [ln 2, 0, ln 1/2] -> k3 = [1 - ln 2, 0, ln 2 - 1/2], gradient [-1, 0, 1/2].
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.config import CorrectionConfig
from megatron_logra.rl.losses import (
    GrpoLossConfig,
    grpo_policy_loss,
    paper_policy_loss,
    rollout_gap_max,
    rollout_mismatch_sums,
)

# Hand examples run in float64; the values pass through exp(log(x)) and a handful of products,
# each rounding by ~1e-16 relative, so 1e-12 leaves three orders of margin.
FP64_TOL = 1e-12

# The paper's weight: truncated importance sampling at cap 2 (rl.loss.correction's default for
# the paper preset).
PAPER = CorrectionConfig(name="tis")
PAPER_LOGP = [[-0.5, -1.0, -2.0], [-0.25, -4.0, -math.inf]]
PAPER_RAW_WEIGHT = [[1.5, 3.0, 0.5], [1.0, 1.0, 1.0]]
MASK = [[True, True, True], [True, True, False]]
PAPER_ADVANTAGES = [2.0, -1.0]


def _paper_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = torch.tensor(PAPER_LOGP, dtype=torch.float64, requires_grad=True)
    raw_weight = torch.tensor(PAPER_RAW_WEIGHT, dtype=torch.float64)
    rollout = logp.detach() - raw_weight.log()
    rollout[1, 2] = math.nan  # padding holds garbage; it must not leak into loss or gradient
    return logp, rollout, torch.tensor(PAPER_ADVANTAGES, dtype=torch.float64), torch.tensor(MASK)


def test_paper_loss_sum_count_and_metrics_match_hand_computed_values():
    logp, rollout, advantages, mask = _paper_inputs()
    loss_sum, num_tokens, metrics = paper_policy_loss(
        logp, rollout, advantages, mask, config=PAPER
    )
    assert loss_sum.item() == pytest.approx(3.25, abs=FP64_TOL)
    assert num_tokens.item() == 5
    assert metrics["importance_weight_sum"].item() == pytest.approx(6.0, abs=FP64_TOL)
    assert metrics["truncated_count"].item() == 1


def test_paper_loss_gradient_is_minus_truncated_weight_times_advantage():
    logp, rollout, advantages, mask = _paper_inputs()
    loss_sum, _, _ = paper_policy_loss(logp, rollout, advantages, mask, config=PAPER)
    loss_sum.backward()
    expected = torch.tensor([[-3.0, -4.0, -1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, rtol=0.0, atol=FP64_TOL)


def test_paper_loss_does_not_differentiate_through_old_or_rollout_logprobs():
    logp, rollout, advantages, mask = _paper_inputs()
    old = logp.detach().clone().requires_grad_(True)
    rollout = rollout.clone().requires_grad_(True)
    loss_sum, _, _ = paper_policy_loss(
        logp, rollout, advantages, mask, config=PAPER, old_logprobs_BL=old
    )
    loss_sum.backward()
    assert old.grad is None
    assert rollout.grad is None
    # Same gradient as with the default old = logp.detach(): the weight is a constant either way.
    expected = torch.tensor([[-3.0, -4.0, -1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, rtol=0.0, atol=FP64_TOL)


def test_paper_loss_cap_is_the_corrections_tis_cap():
    logp, rollout, advantages, mask = _paper_inputs()
    # cap 1: weights [[1, 1, 0.5], [1, 1]] -> loss [[1, 2, 2], [-0.25, -4]] = 0.75
    loss_sum, _, metrics = paper_policy_loss(
        logp, rollout, advantages, mask, config=CorrectionConfig(name="tis", tis_cap=1.0)
    )
    assert loss_sum.item() == pytest.approx(0.75, abs=FP64_TOL)
    assert metrics["truncated_count"].item() == 2


def _grpo_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, -3.0]], dtype=torch.float64)
    ratios = torch.tensor([[1.5, 0.5, 1.1], [1.5, 0.5, 1.1]], dtype=torch.float64)
    logp = (old + ratios.log()).requires_grad_(True)
    advantages = torch.tensor([2.0, -1.0], dtype=torch.float64)
    return logp, old, advantages, torch.ones(2, 3, dtype=torch.bool)


def test_grpo_loss_clips_each_side_for_positive_and_negative_advantages():
    logp, old, advantages, mask = _grpo_inputs()
    loss_sum, num_tokens, metrics = grpo_policy_loss(
        logp, old, advantages, mask, config=GrpoLossConfig()
    )
    assert loss_sum.item() == pytest.approx(-2.2, abs=FP64_TOL)
    assert num_tokens.item() == 6
    assert metrics["clipped_count"].item() == 2
    assert metrics["ratio_sum"].item() == pytest.approx(6.2, abs=FP64_TOL)
    assert "kl_sum" not in metrics
    loss_sum.backward()
    # Clipped tokens (A>0, r>1.2 and A<0, r<0.8) get no gradient; the rest get -r A.
    expected = torch.tensor([[0.0, -1.0, -2.2], [1.5, 0.0, 1.1]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, rtol=0.0, atol=FP64_TOL)


def test_grpo_loss_uses_separate_low_and_high_clip_bounds():
    old = torch.zeros(2, 1, dtype=torch.float64)
    logp = torch.tensor([[math.log(1.25)], [math.log(0.85)]], dtype=torch.float64)
    logp.requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    config = GrpoLossConfig(clip_low=0.1, clip_high=0.3)
    loss_sum, _, metrics = grpo_policy_loss(
        logp, old, advantages, torch.ones(2, 1, dtype=torch.bool), config=config
    )
    # 1.25 < 1 + 0.3: unclipped, loss -1.25.  0.85 < 1 - 0.1 with A < 0: clipped, loss +0.9.
    assert loss_sum.item() == pytest.approx(-1.25 + 0.9, abs=FP64_TOL)
    assert metrics["clipped_count"].item() == 1
    loss_sum.backward()
    torch.testing.assert_close(
        logp.grad, torch.tensor([[-1.25], [0.0]], dtype=torch.float64), rtol=0.0, atol=FP64_TOL
    )


def test_grpo_k3_reference_kl_value_and_gradient_match_closed_form():
    beta = 0.1
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    old = logp.detach()  # r = 1 and A = 0: the surrogate contributes nothing
    reference = logp.detach() + torch.tensor(
        [[math.log(2.0), 0.0, math.log(0.5)]], dtype=torch.float64
    )
    reference = reference.clone().requires_grad_(True)
    loss_sum, _, metrics = grpo_policy_loss(
        logp, old, torch.zeros(1, dtype=torch.float64), torch.ones(1, 3, dtype=torch.bool),
        config=GrpoLossConfig(kl_beta=beta), reference_logprobs_BL=reference,
    )
    kl = (1.0 - math.log(2.0)) + 0.0 + (math.log(2.0) - 0.5)
    assert metrics["kl_sum"].item() == pytest.approx(kl, abs=FP64_TOL)
    assert loss_sum.item() == pytest.approx(beta * kl, abs=FP64_TOL)
    loss_sum.backward()
    expected = beta * torch.tensor([[-1.0, 0.0, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, rtol=0.0, atol=FP64_TOL)
    assert reference.grad is None


def test_grpo_loss_does_not_differentiate_through_old_logprobs():
    logp, old, advantages, mask = _grpo_inputs()
    old = old.clone().requires_grad_(True)
    loss_sum, _, _ = grpo_policy_loss(logp, old, advantages, mask, config=GrpoLossConfig())
    loss_sum.backward()
    assert old.grad is None


def _random_batch(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (4, 6)
    logp = -torch.rand(shape, generator=generator, dtype=torch.float64) * 3
    return {
        "logp": logp,
        "other": logp + 0.5 * torch.randn(shape, generator=generator, dtype=torch.float64),
        "reference": logp + 0.3 * torch.randn(shape, generator=generator, dtype=torch.float64),
        "advantages": torch.randn(4, generator=generator, dtype=torch.float64),
        "mask": torch.rand(shape, generator=generator) < 0.7,
    }


def _paper(batch: dict[str, torch.Tensor], logp: torch.Tensor, rows: slice):
    return paper_policy_loss(
        logp[rows], batch["other"][rows], batch["advantages"][rows], batch["mask"][rows],
        config=PAPER,
    )


def _grpo(batch: dict[str, torch.Tensor], logp: torch.Tensor, rows: slice):
    return grpo_policy_loss(
        logp[rows], batch["other"][rows], batch["advantages"][rows], batch["mask"][rows],
        config=GrpoLossConfig(kl_beta=0.05), reference_logprobs_BL=batch["reference"][rows],
    )


@pytest.mark.parametrize("loss_fn", [_paper, _grpo], ids=["paper", "grpo"])
def test_two_microbatches_give_the_whole_batch_token_mean_and_gradient(loss_fn):
    batch = _random_batch(seed=0)
    whole_logp = batch["logp"].clone().requires_grad_(True)
    whole = loss_fn(batch, whole_logp, slice(0, 4))
    (whole.loss_sum / whole.num_tokens).backward()

    split_logp = batch["logp"].clone().requires_grad_(True)
    parts = [loss_fn(batch, split_logp, slice(0, 1)), loss_fn(batch, split_logp, slice(1, 4))]
    global_tokens = sum(part.num_tokens for part in parts)
    assert global_tokens.item() == whole.num_tokens.item() == int(batch["mask"].sum())
    # As the trainer does: each microbatch's sum over the global token count, gradients add up.
    for part in parts:
        (part.loss_sum / global_tokens).backward()
    split_mean = sum(part.loss_sum.detach() for part in parts) / global_tokens
    whole_mean = whole.loss_sum / whole.num_tokens
    assert split_mean.item() == pytest.approx(whole_mean.item(), abs=FP64_TOL)
    torch.testing.assert_close(split_logp.grad, whole_logp.grad, rtol=0.0, atol=FP64_TOL)
    for key, value in whole.metrics.items():
        combine = max if key.endswith("_max") else sum
        split_value = combine(part.metrics[key] for part in parts)
        assert split_value.item() == pytest.approx(value.item(), abs=FP64_TOL)


def test_rollout_mismatch_sums_only_valid_tokens_of_completed_responses():
    train = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0], [-0.5, -0.5, -9.0]])
    rollout = torch.tensor([[-1.5, -1.75, -3.0], [-2.0, -2.0, -2.0], [-0.25, -1.0, 7.0]])
    mask = torch.tensor([[True, True, True], [True, True, True], [True, True, False]])
    completed = torch.tensor([True, False, True])
    gap_sum, num_tokens = rollout_mismatch_sums(train, rollout, mask, completed)
    # Row 0: -0.5 + 0.25 + 0; row 1 is truncated (not counted); row 2: 0.25 - 0.5 (pad skipped).
    assert gap_sum.dtype == torch.float64
    assert gap_sum.item() == pytest.approx(-0.5, abs=FP64_TOL)
    assert num_tokens.item() == 5


def test_rollout_gap_max_is_the_largest_per_token_gap_that_a_mean_cancels():
    train = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    rollout = torch.tensor([[-1.25, -1.75, -3.0], [-0.5, -0.5, 7.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # Opposite gaps of 0.25 sum to 0 over the valid tokens; the padding's 16 is not counted.
    assert rollout_mismatch_sums(train, rollout, mask, torch.ones(2, dtype=torch.bool)
                                 ).gap_sum.item() == 0.0
    gap = rollout_gap_max(train, rollout, mask)
    assert gap.dtype == torch.float64 and gap.item() == 0.25


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rollout_logprobs_BL": torch.zeros(2, 2)}, "rollout_logprobs has shape"),
        ({"advantages_B": torch.zeros(3)}, "advantages has shape"),
        ({"response_mask_BL": torch.full((2, 3), 2.0)}, "response_mask must be bool"),
    ],
)
def test_paper_loss_rejects_malformed_inputs_naming_them(kwargs, match):
    logp, rollout, advantages, mask = _paper_inputs()
    inputs = {"logprobs_BL": logp, "rollout_logprobs_BL": rollout, "advantages_B": advantages,
              "response_mask_BL": mask, **kwargs}
    with pytest.raises(ValueError, match=match):
        paper_policy_loss(**inputs, config=PAPER)


def test_grpo_loss_with_kl_needs_reference_logprobs():
    logp, old, advantages, mask = _grpo_inputs()
    with pytest.raises(ValueError, match="kl_beta=0.1 needs reference_logprobs"):
        grpo_policy_loss(logp, old, advantages, mask, config=GrpoLossConfig(kl_beta=0.1))


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (CorrectionConfig(tis_cap=0.0), "tis_cap"),
        (CorrectionConfig(mask_low=2.0, mask_high=1.0), "mask_low"),
        (CorrectionConfig(name="clip"), "correction.name"),
        (GrpoLossConfig(clip_low=1.0), "clip_low"),
        (GrpoLossConfig(clip_high=-0.1), "clip_high"),
        (GrpoLossConfig(kl_beta=-1.0), "kl_beta"),
    ],
)
def test_loss_configs_reject_invalid_values_naming_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        config.validate()
