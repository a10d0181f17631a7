"""The unbiased pass@k estimator (Chen et al., 2021, "Evaluating Large Language Models Trained on
Code").

Given n sampled responses to one problem, c of them correct, the probability that a uniformly drawn
k-subset contains at least one correct response is

    pass@k = 1 - C(n - c, k) / C(n, k).

The binomials overflow floats for moderate n, so the ratio is taken as a product of k-or-fewer
factors instead:

    C(n - c, k) / C(n, k) = prod_{i = n-c+1}^{n} (1 - k / i)        (for n - c >= k)

and is 0 (pass@k = 1) when n - c < k, because then every k-subset holds a correct response.
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``num_correct`` correct out of ``num_samples``."""
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples} must be >= 1; sample at least one response")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(
            f"num_correct={num_correct} must be in [0, num_samples={num_samples}]; count only "
            "this problem's responses"
        )
    if not 1 <= k <= num_samples:
        raise ValueError(
            f"k={k} must be in [1, num_samples={num_samples}]; pass@k needs at least k samples "
            "per problem, so lower k or sample more"
        )
    num_wrong = num_samples - num_correct
    if num_wrong < k:
        return 1.0
    all_wrong_probability = 1.0
    for i in range(num_wrong + 1, num_samples + 1):
        all_wrong_probability *= 1.0 - k / i
    return 1.0 - all_wrong_probability


def mean_pass_at_k(num_samples: int, num_correct: Sequence[int], k: int) -> float:
    """pass@k averaged over problems, each with ``num_samples`` responses and
    ``num_correct[j]`` of them correct."""
    if len(num_correct) == 0:
        raise ValueError("num_correct is empty; pass the correct-count of at least one problem")
    total = 0.0
    for count in num_correct:
        total += pass_at_k(num_samples, count, k)
    return total / len(num_correct)
