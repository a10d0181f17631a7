"""pass@k against exact enumeration of every k-subset and against hand-computed values."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from megatron_logra.rl.pass_at_k import mean_pass_at_k, pass_at_k

# The product form multiplies at most c float64 factors in [0, 1], each step rounding by <= 2^-53
# relative, so the absolute error is <= 2c * 2^-53: under 1.2e-13 for the largest case here
# (c = 500), and pass@k = 1 - product adds one more rounding.
FLOAT64_ABS_TOL = 1e-12


def _brute_force(num_samples: int, num_correct: int, k: int) -> Fraction:
    """Fraction of k-subsets of the samples that contain at least one correct sample."""
    samples = [True] * num_correct + [False] * (num_samples - num_correct)
    subsets = list(itertools.combinations(range(num_samples), k))
    hits = sum(any(samples[i] for i in subset) for subset in subsets)
    return Fraction(hits, len(subsets))


@pytest.mark.parametrize("num_samples", range(1, 9))
def test_pass_at_k_equals_fraction_of_k_subsets_with_a_correct_sample(num_samples):
    for num_correct in range(num_samples + 1):
        for k in range(1, num_samples + 1):
            expected = _brute_force(num_samples, num_correct, k)
            assert pass_at_k(num_samples, num_correct, k) == pytest.approx(
                float(expected), abs=FLOAT64_ABS_TOL
            )


def test_pass_at_k_hand_values():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2.
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5, abs=FLOAT64_ABS_TOL)
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 7/10.
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=FLOAT64_ABS_TOL)
    # k=1 is the fraction correct.
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=FLOAT64_ABS_TOL)
    # Fewer than k wrong samples: every k-subset contains a correct one.
    assert pass_at_k(5, 4, 2) == 1.0
    assert pass_at_k(5, 0, 5) == 0.0


def test_pass_at_k_is_stable_where_binomials_overflow_floats():
    # C(2000, 1000) ~ 2e600 overflows float64; the ratio C(1500,1000)/C(2000,1000) does not.
    expected = 1.0 - math.comb(1500, 1000) / math.comb(2000, 1000)  # exact big-int ratio
    assert pass_at_k(2000, 500, 1000) == pytest.approx(expected, abs=FLOAT64_ABS_TOL)


def test_mean_pass_at_k_averages_problems():
    # Problems with c = 1 and c = 2 of n = 4, k = 2: (1/2 + (1 - 1/6)) / 2 = 2/3.
    assert mean_pass_at_k(4, [1, 2], 2) == pytest.approx(2.0 / 3.0, abs=FLOAT64_ABS_TOL)


@pytest.mark.parametrize(
    ("num_samples", "num_correct", "k", "field"),
    [
        (4, 1, 5, "k=5"),
        (4, 1, 0, "k=0"),
        (4, 5, 1, "num_correct=5"),
        (4, -1, 1, "num_correct=-1"),
        (0, 0, 1, "num_samples=0"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_them(num_samples, num_correct, k, field):
    with pytest.raises(ValueError, match=field):
        pass_at_k(num_samples, num_correct, k)


def test_mean_pass_at_k_of_no_problems_raises():
    with pytest.raises(ValueError, match="num_correct is empty"):
        mean_pass_at_k(4, [], 1)
