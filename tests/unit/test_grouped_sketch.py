"""Grouped expert sketches (megatron_logra/grouped_sketch.py) equal the per-expert loop the
SequentialMLP path computes, idle experts included; bad splits are refused."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.grouped_sketch import (
    grouped_projected_inputs,
    grouped_sketches,
    loop_sketches,
)

# fp32 grouped vs fp32 loop: the same products, summed in another blocking at most.
FP32_REL = 1e-5
# bf16 inputs and a bf16 output: one rounding of each P and S entry (2^-8) and bf16 products.
BF16_REL = 2e-2


def _case(dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)
    tokens = torch.tensor([5, 0, 17, 1, 9])  # expert 1 idle
    t, n, m, r = int(tokens.sum()), 32, 24, 8
    x = torch.randn(t, n, generator=g).to(dtype)
    h = torch.randn(t, m, generator=g).to(dtype)
    proj = (torch.randn(len(tokens), r, n, generator=g) / r**0.5).to(dtype)
    return x, h, proj, tokens


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, FP32_REL), (torch.bfloat16, BF16_REL)])
def test_grouped_sketches_equal_the_per_expert_loop_and_an_idle_expert_is_exactly_zero(
        dtype, tolerance):
    x, h, proj, tokens = _case(dtype)
    grouped = grouped_sketches(h, grouped_projected_inputs(x, proj, tokens), tokens)
    reference = loop_sketches(x.double(), h.double(), proj.double(), tokens, torch.float64)
    assert grouped.shape == reference.shape == (5, 24, 8)
    assert _rel(grouped, reference) <= tolerance
    assert torch.count_nonzero(grouped[1]) == 0


def test_projected_inputs_are_each_experts_own_projection():
    x, _, proj, tokens = _case(torch.float32)
    projected = grouped_projected_inputs(x, proj, tokens)
    start = 0
    for e, count in enumerate(tokens.tolist()):
        if count:
            want = x[start:start + count] @ proj[e].t()
            assert _rel(projected[start:start + count], want) <= FP32_REL
        start += count


def test_a_split_that_does_not_cover_the_tokens_is_refused():
    x, _, proj, _ = _case(torch.float32)
    with pytest.raises(ValueError, match="tokens_per_expert sums to 31"):
        grouped_projected_inputs(x, proj, torch.tensor([5, 0, 16, 1, 9]))
    with pytest.raises(ValueError, match="counts >= 0"):
        grouped_projected_inputs(x, proj, torch.tensor([5, -1, 18, 1, 9]))
