"""Per-token KL: the Fisher prediction against hand values, the explicit quadratic form and the
exact KL; the exact KL against its definition; masking, chunking and vocabulary padding.

The vocab-parallel forms need a real tensor-parallel group and are checked against these full
forms in tests/distributed/test_logit_jvp.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.kl import TokenSum, exact_kl, predicted_kl

# A few float64 reductions over <= 64 vocabulary entries of O(1) values: rounding ~1e-15.
FLOAT64_REL_TOL = 1e-12
# Shifting the tangent by 1e3 costs ~1e3 * 2**-52 absolute in the centred values (~1e-13).
SHIFT_INVARIANCE_REL_TOL = 1e-10
# Halving the step must halve the relative error of the second-order prediction (the next term
# is third order). Measured ratios for the steps below are 1.98-2.08; the 10% band leaves room
# for the fourth-order term at the largest step and still rejects O(1) or O(h^2) behaviour.
ERROR_RATIO_BOUNDS = (1.8, 2.2)
# The relative error at step h is ~c * h with c set by the third cumulant of dz under p (about
# 0.04-0.06 for these random logits); c < 1 says the prediction is good to O(h), not O(1).
LINEAR_ERROR_COEFFICIENT_BOUND = 1.0


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _random_logits(positions: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(positions, vocab, generator=generator, dtype=torch.float64)
    tangent = torch.randn(positions, vocab, generator=generator, dtype=torch.float64)
    return logits, tangent


def test_predicted_kl_of_hand_computed_two_token_examples() -> None:
    # p = (1/2, 1/2), u = (1, -1): Var = 1, m = 1/2.
    result = predicted_kl(torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, -1.0]]), temperature=1.0)
    assert float(result.total) == pytest.approx(0.5, rel=FLOAT64_REL_TOL)
    assert float(result.count) == 1.0
    # Same at T = 2: u = (1/2, -1/2), Var = 1/4, m = 1/8 (z / T is still uniform).
    result = predicted_kl(torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, -1.0]]), temperature=2.0)
    assert float(result.total) == pytest.approx(0.125, rel=FLOAT64_REL_TOL)
    # p = (3/4, 1/4), u = (1, 0): E u = 3/4, Var = 3/4 * 1/16 + 1/4 * 9/16 = 3/16, m = 3/32.
    logits = torch.tensor([[math.log(3.0), 0.0]], dtype=torch.float64)
    result = predicted_kl(logits, torch.tensor([[1.0, 0.0]], dtype=torch.float64), temperature=1.0)
    assert float(result.total) == pytest.approx(3.0 / 32.0, rel=FLOAT64_REL_TOL)


def test_predicted_kl_equals_the_fisher_quadratic_form() -> None:
    logits, tangent = _random_logits(6, 40, seed=1)
    temperature = 0.7
    expected = 0.0
    for z, dz in zip(logits, tangent, strict=True):
        p = torch.softmax(z / temperature, dim=0)
        fisher = torch.diag(p) - torch.outer(p, p)
        expected += 0.5 * float(dz @ fisher @ dz) / temperature**2
    result = predicted_kl(logits, tangent, temperature=temperature)
    assert _rel(float(result.total), expected) < FLOAT64_REL_TOL
    assert float(result.count) == 6.0


def test_exact_kl_equals_its_definition() -> None:
    old, delta = _random_logits(5, 30, seed=2)
    new = old + 0.3 * delta
    temperature = 1.3
    log_p = torch.log_softmax(old / temperature, dim=-1)
    log_q = torch.log_softmax(new / temperature, dim=-1)
    expected = float((log_p.exp() * (log_p - log_q)).sum())
    result = exact_kl(old, new, temperature=temperature)
    assert _rel(float(result.total), expected) < FLOAT64_REL_TOL


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_predicted_kl_matches_exact_kl_to_second_order_with_error_linear_in_step(
    temperature: float,
) -> None:
    logits, tangent = _random_logits(8, 50, seed=3)
    fisher = float(predicted_kl(logits, tangent, temperature=temperature).total)
    steps = [2e-2, 1e-2, 5e-3, 2.5e-3]
    errors = []
    for step in steps:
        exact = float(exact_kl(logits, logits + step * tangent, temperature=temperature).total)
        errors.append(_rel(step**2 * fisher, exact))
    ratios = [errors[i] / errors[i + 1] for i in range(len(errors) - 1)]
    for ratio in ratios:
        assert ERROR_RATIO_BOUNDS[0] < ratio < ERROR_RATIO_BOUNDS[1], (errors, ratios)
    assert errors[-1] < LINEAR_ERROR_COEFFICIENT_BOUND * steps[-1], errors


def test_predicted_kl_is_invariant_to_a_constant_shift_of_the_tangent() -> None:
    # Adding the same value to every logit change leaves the distribution unchanged.
    logits, tangent = _random_logits(4, 64, seed=4)
    base = float(predicted_kl(logits, tangent, temperature=1.0).total)
    shifted = float(predicted_kl(logits, tangent + 1e3, temperature=1.0).total)
    assert _rel(shifted, base) < SHIFT_INVARIANCE_REL_TOL


def test_mask_selects_positions_and_chunking_does_not_change_the_sum() -> None:
    logits, tangent = _random_logits(12, 20, seed=5)
    logits, tangent = logits.reshape(3, 4, 20), tangent.reshape(3, 4, 20)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[0, 1] = mask[1, 3] = mask[2, 0] = mask[2, 2] = True
    selected = predicted_kl(logits[mask], tangent[mask], temperature=1.0)
    for chunk_positions in (1, 3, 64):
        masked = predicted_kl(
            logits, tangent, temperature=1.0, mask=mask, chunk_positions=chunk_positions
        )
        assert float(masked.count) == 4.0
        assert _rel(float(masked.total), float(selected.total)) < FLOAT64_REL_TOL
        exact_masked = exact_kl(
            logits, logits + 0.1 * tangent, temperature=1.0, mask=mask,
            chunk_positions=chunk_positions,
        )
        exact_selected = exact_kl(logits[mask], (logits + 0.1 * tangent)[mask], temperature=1.0)
        assert float(exact_masked.count) == 4.0
        assert _rel(float(exact_masked.total), float(exact_selected.total)) < FLOAT64_REL_TOL


def test_vocab_size_excludes_padding_entries() -> None:
    logits, tangent = _random_logits(5, 32, seed=6)
    real = 29
    padded = predicted_kl(logits, tangent, temperature=0.9, vocab_size=real)
    truncated = predicted_kl(logits[:, :real], tangent[:, :real], temperature=0.9)
    assert _rel(float(padded.total), float(truncated.total)) < FLOAT64_REL_TOL
    new = logits + 0.2 * tangent
    padded = exact_kl(logits, new, temperature=0.9, vocab_size=real)
    truncated = exact_kl(logits[:, :real], new[:, :real], temperature=0.9)
    assert _rel(float(padded.total), float(truncated.total)) < FLOAT64_REL_TOL


def test_float32_inputs_are_evaluated_in_float64() -> None:
    logits, tangent = _random_logits(3, 16, seed=7)
    logits32, tangent32 = logits.float(), tangent.float()
    from32 = predicted_kl(logits32, tangent32, temperature=1.0)
    from64 = predicted_kl(logits32.double(), tangent32.double(), temperature=1.0)
    assert from32.total.dtype == torch.float64
    assert float(from32.total) == float(from64.total)


def test_token_sum_mean_and_empty_probe_set() -> None:
    total = TokenSum(total=torch.tensor(3.0, dtype=torch.float64),
                     count=torch.tensor(4.0, dtype=torch.float64))
    assert total.mean() == 0.75
    empty = predicted_kl(
        torch.zeros(2, 5), torch.zeros(2, 5), temperature=1.0,
        mask=torch.zeros(2, dtype=torch.bool),
    )
    assert float(empty.count) == 0.0
    with pytest.raises(RuntimeError, match="zero positions"):
        empty.mean()


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.nan, math.inf])
def test_invalid_temperature_raises_value_error(temperature: float) -> None:
    with pytest.raises(ValueError, match="temperature"):
        predicted_kl(torch.zeros(1, 3), torch.zeros(1, 3), temperature=temperature)
    with pytest.raises(ValueError, match="temperature"):
        exact_kl(torch.zeros(1, 3), torch.zeros(1, 3), temperature=temperature)


def test_malformed_inputs_raise_value_error() -> None:
    with pytest.raises(ValueError, match="same shape"):
        predicted_kl(torch.zeros(2, 3), torch.zeros(2, 4), temperature=1.0)
    with pytest.raises(ValueError, match="mask"):
        predicted_kl(torch.zeros(2, 3), torch.zeros(2, 3), temperature=1.0,
                     mask=torch.ones(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="mask"):
        predicted_kl(torch.zeros(2, 3), torch.zeros(2, 3), temperature=1.0,
                     mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="vocab_size"):
        predicted_kl(torch.zeros(2, 3), torch.zeros(2, 3), temperature=1.0, vocab_size=0)
    with pytest.raises(ValueError, match="chunk_positions"):
        exact_kl(torch.zeros(2, 3), torch.zeros(2, 3), temperature=1.0, chunk_positions=0)
