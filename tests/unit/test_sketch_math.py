"""The sketch identities of LoGRA against float64 references.

``S = sum_mb H^T (X A^T) = G A^T`` with ``G = sum_mb H^T X``; ``||S A||^2`` through the Gram matrix;
the merged update ``(1 - lr wd) W - lr D A``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.projection import generate_projection, projection_key
from megatron_logra.sketch import (
    accumulate_sketch_,
    apply_low_rank_update_,
    project_activations,
    reconstructed_sq_norm,
)

# fp32 results vs float64 references: inner products of length <= a few hundred with O(1) entries
# lose at most ~sqrt(length) * 2^-24 relative to the result's scale; 1e-5 of the reference's
# largest magnitude leaves a margin of ~10x over that for every case here.
FP32_REL_TOL = 1e-5
# A product rounded to bf16 errs by up to 2^-8 of its scale; the fp32 accumulation of the same
# bf16-representable inputs must stay at least 10x below that (it is ~1e-7 in practice).
BF16_PRODUCT_REL_ERROR = 2.0**-8
FP32_ACCUMULATION_MAX_REL_ERROR = 0.1 * BF16_PRODUCT_REL_ERROR
# float64 results vs float64 references computed in a different association order: a few hundred
# roundings of 2^-53 each, far below 1e-12 of the result's scale.
FP64_REL_TOL = 1e-12

OUT, IN, SKETCH_RANK = 24, 40, 8
MICROBATCH_TOKENS = (5, 11, 7)


def _close(actual: torch.Tensor, expected: torch.Tensor, rel: float = FP32_REL_TOL) -> bool:
    scale = expected.abs().max().item()
    return (actual.double() - expected).abs().max().item() <= rel * scale


def _microbatches(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(t, OUT, generator=gen, dtype=torch.float64),
         torch.randn(t, IN, generator=gen, dtype=torch.float64))
        for t in MICROBATCH_TOKENS
    ]


def _projection(distribution: str, sketch_rank: int = SKETCH_RANK) -> torch.Tensor:
    key = projection_key(0, 3, "decoder.layers.0.mlp.linear_fc2")
    return generate_projection(key, sketch_rank, 0, IN, distribution, dtype=torch.float64)


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_accumulated_sketch_over_microbatches_equals_dense_gradient_times_projection_transpose(
    distribution,
):
    batches = _microbatches(0)
    proj64 = _projection(distribution)
    sketch = torch.zeros(OUT, SKETCH_RANK, dtype=torch.float32)
    for grad_out, inputs in batches:
        projected = project_activations(inputs.float(), proj64.float())
        accumulate_sketch_(sketch, grad_out.float(), projected)
    dense_grad = sum(h.t() @ x for h, x in batches)
    assert _close(sketch, dense_grad @ proj64.t())


def test_projected_activations_equal_inputs_times_projection_transpose():
    inputs = _microbatches(1)[0][1]
    proj64 = _projection("rademacher")
    projected = project_activations(inputs.float(), proj64.float())
    expected = torch.einsum("ti,ri->tr", inputs, proj64)
    assert _close(projected, expected)


def test_sketch_with_identity_projection_equals_dense_gradient():
    batches = _microbatches(2)
    eye = _projection("identity", sketch_rank=IN)
    sketch = torch.zeros(OUT, IN, dtype=torch.float32)
    for grad_out, inputs in batches:
        accumulate_sketch_(sketch, grad_out.float(), project_activations(inputs.float(), eye.float()))
    assert _close(sketch, sum(h.t() @ x for h, x in batches))


def test_bf16_activations_are_accumulated_in_fp32():
    grad_out, inputs = _microbatches(3)[1]
    proj = _projection("rademacher").float()
    grad_bf16 = grad_out.to(torch.bfloat16)
    projected_bf16 = project_activations(inputs.float(), proj).to(torch.bfloat16)
    sketch = torch.zeros(OUT, SKETCH_RANK, dtype=torch.float32)
    accumulate_sketch_(sketch, grad_bf16, projected_bf16)
    # Reference: the exact product of the bf16 values the function was given.
    expected = grad_bf16.double().t() @ projected_bf16.double()
    assert _close(sketch, expected)
    # and the fp32 path is much closer than a product rounded to bf16 could be.
    scale = expected.abs().max().item()
    err = (sketch.double() - expected).abs().max().item()
    assert err < FP32_ACCUMULATION_MAX_REL_ERROR * scale


def test_float64_sketch_accumulates_in_float64():
    # Reference computations keep a float64 sketch; fp32 inputs must not pull it down to fp32.
    batches = _microbatches(8)
    proj64 = _projection("gaussian")
    sketch = torch.zeros(OUT, SKETCH_RANK, dtype=torch.float64)
    for grad_out, inputs in batches:
        accumulate_sketch_(sketch, grad_out, project_activations(inputs, proj64))
    expected = sum(h.t() @ x for h, x in batches) @ proj64.t()
    assert sketch.dtype == torch.float64
    assert _close(sketch, expected, rel=FP64_REL_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_accumulate_sketch_rejects_16_bit_sketch(dtype):
    sketch = torch.zeros(OUT, SKETCH_RANK, dtype=dtype)
    with pytest.raises(RuntimeError, match="float32"):
        accumulate_sketch_(sketch, torch.zeros(3, OUT), torch.zeros(3, SKETCH_RANK))


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_reconstructed_sq_norm_equals_frobenius_norm_of_explicit_reconstruction(distribution):
    gen = torch.Generator().manual_seed(4)
    sketch64 = torch.randn(OUT, SKETCH_RANK, generator=gen, dtype=torch.float64)
    proj64 = _projection(distribution)
    got = reconstructed_sq_norm(sketch64.float(), proj64.float())
    expected = (sketch64 @ proj64).pow(2).sum().item()
    assert got.dtype == torch.float64
    assert abs(got.item() - expected) <= FP32_REL_TOL * expected


def test_reconstructed_sq_norm_with_identity_projection_equals_dense_gradient_sq_norm():
    batches = _microbatches(5)
    dense_grad = sum(h.t() @ x for h, x in batches)
    eye = _projection("identity", sketch_rank=IN)
    got = reconstructed_sq_norm(dense_grad.float(), eye.float()).item()
    expected = dense_grad.pow(2).sum().item()
    assert abs(got - expected) <= FP32_REL_TOL * expected


def test_reconstructed_sq_norm_is_exact_in_float64():
    # In float64 the Gram route and explicit reconstruction agree to float64 rounding.
    gen = torch.Generator().manual_seed(6)
    sketch64 = torch.randn(OUT, SKETCH_RANK, generator=gen, dtype=torch.float64)
    proj64 = _projection("gaussian")
    got = reconstructed_sq_norm(sketch64, proj64).item()
    expected = (sketch64 @ proj64).pow(2).sum().item()
    assert abs(got - expected) <= FP64_REL_TOL * expected


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_apply_low_rank_update_equals_decayed_weight_minus_lr_direction_times_projection(
    weight_decay,
):
    gen = torch.Generator().manual_seed(7)
    weight64 = torch.randn(OUT, IN, generator=gen, dtype=torch.float64)
    direction64 = torch.randn(OUT, SKETCH_RANK, generator=gen, dtype=torch.float64)
    proj64 = _projection("rademacher")
    lr = 0.05
    weight = weight64.float()
    apply_low_rank_update_(weight, direction64.float(), proj64.float(), lr=lr,
                           weight_decay=weight_decay)
    expected = (1.0 - lr * weight_decay) * weight64.float().double()
    expected -= lr * direction64.float().double() @ proj64
    assert _close(weight, expected)


def test_apply_low_rank_update_by_hand():
    # W = [[1, 2], [3, 4]], D = [[1], [-1]], A = [[2, 4]], lr 0.5, wd 0.2:
    # (1 - 0.1) W = [[0.9, 1.8], [2.7, 3.6]]; lr D A = [[1, 2], [-1, -2]]
    weight = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    apply_low_rank_update_(
        weight, torch.tensor([[1.0], [-1.0]]), torch.tensor([[2.0, 4.0]]), lr=0.5,
        weight_decay=0.2,
    )
    expected = torch.tensor([[-0.1, -0.2], [3.7, 5.6]], dtype=torch.float64)
    assert _close(weight, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_apply_low_rank_update_rejects_non_fp32_weight(dtype):
    weight = torch.zeros(OUT, IN, dtype=dtype)
    with pytest.raises(RuntimeError, match="float32"):
        apply_low_rank_update_(
            weight, torch.zeros(OUT, SKETCH_RANK), torch.zeros(SKETCH_RANK, IN), lr=0.1
        )
