"""RowAdam (library mode) against hand-computed values.

Hand example, beta2 = 1/2, two rows, sketch rank 2 (every v below is exact in binary):

    step 1: S = [[1, 7], [2, 2]]      mean S^2 = [25, 4]     v = [12.5, 2]    bc = 1/2
            vhat = [25, 4]            sqrt(vhat) = [5, 2]
    step 2: S = [[1, -1], [2, -2]]    mean S^2 = [1, 4]      v = [6.75, 3]    bc = 3/4
            vhat = [9, 4]             sqrt(vhat) = [3, 2]
    step 3: S = [[.5, -.5], [2, 2]]   mean S^2 = [.25, 4]    v = [3.5, 3.5]   bc = 7/8
            vhat = [4, 4]             sqrt(vhat) = [2, 2]

and D = S / (sqrt(vhat) + eps).
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.row_adam import row_adam_direction, update_row_second_moment_

# D involves one fp32 division per entry after an fp32 sqrt of exact values: within a few ulps
# (2^-24 ~ 6e-8 each) of the float64 value.
FP32_REL_TOL = 4e-7
# Step-1 scale invariance: D(cS) / D(S) = (rms + eps) / (rms + eps / c) per row, which differs
# from 1 by at most eps * |1 - 1/c| / rms (the eps effect, computed in the test from the data);
# on top of that both directions carry a few fp32 ulps of rounding (2^-24 ~ 6e-8 each).
SCALE_ROUNDING_REL_TOL = 1e-6
# With beta2 = 0.95 the fp32 values of (1 - beta2) in the moment and in the bias correction are
# rounded differently, so v / bc is a few ulps off the row mean square, on top of the division.
BIAS_CORRECTED_REL_TOL = 10 * FP32_REL_TOL
SCALE_EPS = 1e-8

HAND_BETA2 = 0.5
HAND_SKETCHES = [
    [[1.0, 7.0], [2.0, 2.0]],
    [[1.0, -1.0], [2.0, -2.0]],
    [[0.5, -0.5], [2.0, 2.0]],
]
HAND_MOMENTS = [[12.5, 2.0], [6.75, 3.0], [3.5, 3.5]]
HAND_SQRT_VHAT = [[5.0, 2.0], [3.0, 2.0], [2.0, 2.0]]


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_three_steps_match_hand_computed_moments_and_directions(eps):
    moment = torch.zeros(2, dtype=torch.float32)
    for step, (sketch, v, sqrt_vhat) in enumerate(
        zip(HAND_SKETCHES, HAND_MOMENTS, HAND_SQRT_VHAT, strict=True), start=1
    ):
        sketch_t = torch.tensor(sketch, dtype=torch.float32)
        direction = row_adam_direction(sketch_t, moment, step=step, beta2=HAND_BETA2, eps=eps)
        # All moments are exact binary fractions and every operation on them is exact in fp32.
        assert torch.equal(moment, torch.tensor(v, dtype=torch.float32))
        expected = torch.tensor(sketch, dtype=torch.float64) / (
            torch.tensor(sqrt_vhat, dtype=torch.float64)[:, None] + eps
        )
        assert direction.dtype == torch.float32
        assert _rel_err(direction, expected) < FP32_REL_TOL


def test_direction_at_first_step_with_eps_zero_is_pinned():
    direction = row_adam_direction(
        torch.tensor(HAND_SKETCHES[0]), torch.zeros(2), step=1, beta2=HAND_BETA2, eps=0.0
    )
    expected = torch.tensor([[0.2, 1.4], [1.0, 1.0]], dtype=torch.float64)
    assert _rel_err(direction, expected) < FP32_REL_TOL


def test_second_moment_update_is_ema_of_row_mean_square():
    # v = 0.9 * [1, 2] + 0.1 * [mean(9, 16), mean(0, 4)] = [0.9 + 1.25, 1.8 + 0.2] = [2.15, 2.0]
    moment = torch.tensor([1.0, 2.0])
    update_row_second_moment_(moment, torch.tensor([[3.0, 4.0], [0.0, 2.0]]), beta2=0.9)
    assert _rel_err(moment, torch.tensor([2.15, 2.0], dtype=torch.float64)) < FP32_REL_TOL


def test_sketch_is_not_modified():
    sketch = torch.tensor(HAND_SKETCHES[0])
    before = sketch.clone()
    row_adam_direction(sketch, torch.zeros(2), step=1, beta2=0.95, eps=1e-8)
    assert torch.equal(sketch, before)


@pytest.mark.parametrize("scale", [1e-3, 7.0, 1e3])
def test_first_step_direction_is_invariant_to_sketch_scale(scale):
    gen = torch.Generator().manual_seed(0)
    sketch = torch.randn(16, 32, generator=gen)
    base = row_adam_direction(sketch, torch.zeros(16), step=1, beta2=0.95, eps=SCALE_EPS)
    scaled = row_adam_direction(
        sketch * scale, torch.zeros(16), step=1, beta2=0.95, eps=SCALE_EPS
    )
    min_rms = sketch.double().pow(2).mean(dim=1).sqrt().min().item()
    eps_effect = SCALE_EPS * abs(1.0 - 1.0 / scale) / min_rms
    assert _rel_err(scaled, base.double()) < SCALE_ROUNDING_REL_TOL + eps_effect


def test_first_step_direction_is_sketch_over_row_rms():
    # At t = 1 bias correction cancels (1 - beta2) exactly: D = S / (rms_row(S) + eps).
    gen = torch.Generator().manual_seed(1)
    sketch64 = torch.randn(8, 16, generator=gen, dtype=torch.float64)
    direction = row_adam_direction(sketch64.float(), torch.zeros(8), step=1, beta2=0.95, eps=1e-8)
    rms = sketch64.float().double().pow(2).mean(dim=1).sqrt()
    expected = sketch64.float().double() / (rms[:, None] + 1e-8)
    assert _rel_err(direction, expected) < BIAS_CORRECTED_REL_TOL


@pytest.mark.parametrize("beta2", [1.0, -0.1, 1.5])
def test_beta2_outside_unit_interval_raises_value_error(beta2):
    with pytest.raises(ValueError, match="beta2"):
        row_adam_direction(torch.ones(2, 2), torch.zeros(2), step=1, beta2=beta2, eps=1e-8)
    with pytest.raises(ValueError, match="beta2"):
        update_row_second_moment_(torch.zeros(2), torch.ones(2, 2), beta2=beta2)


@pytest.mark.parametrize("step", [0, -1])
def test_step_below_one_raises_value_error(step):
    with pytest.raises(ValueError, match="1-based"):
        row_adam_direction(torch.ones(2, 2), torch.zeros(2), step=step, beta2=0.95, eps=1e-8)
