"""What the LoGRA step keeps beside the model, made lean without changing a result.

* The projection is held once, in the parameters' dtype: its values were already rounded
  through that dtype (the forward projects bf16 activations with it), so the fp32 update's cast
  of it is exact -- and for Rademacher entries with a power-of-4 sketch rank the rounding is the
  identity, so the bf16 matrix *is* +-1/sqrt(r).
* Paper mode's ``||W_targets||^2`` is a float64 sum over row blocks, not over a float64 copy
  of every target weight.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.mcore.tensor_parallel.sketched_linear import LayerSketch
from megatron_logra.norm_blocks import NORM_BLOCK_ELEMENTS, norm_block_rows
from megatron_logra.projection import generate_projection, projection_key
from megatron_logra.row_adam_paper import blockwise_sq_norm
from megatron_logra.sketch_buffer import FlatSketchBuffer, SketchSlot

KEY = projection_key(7, 3, "decoder.layers.1.mlp.linear_fc2")
FLOAT64_UNIT_ROUNDOFF = 2.0**-53


def _fp32(sketch_rank: int, distribution: str) -> torch.Tensor:
    return generate_projection(KEY, sketch_rank, 0, 96, distribution, dtype=torch.float32)


@pytest.mark.parametrize("sketch_rank", [4, 16, 64, 256])
def test_rademacher_projection_with_power_of_4_rank_is_exact_in_bf16(sketch_rank):
    fp32 = _fp32(sketch_rank, "rademacher")
    assert torch.equal(fp32.to(torch.bfloat16).float(), fp32)
    assert set(fp32.abs().unique().tolist()) == {1.0 / math.sqrt(sketch_rank)}


@pytest.mark.parametrize(("sketch_rank", "distribution"),
                         [(32, "rademacher"), (128, "rademacher"), (16, "gaussian")])
def test_projection_other_ranks_and_gaussian_are_rounded_by_bf16(sketch_rank, distribution):
    """Not exact: the optimizer rounds them through bf16 once, and both the forward and the
    update use that rounded matrix (the rollout engine rounds alike: ``projection_dtype``)."""
    fp32 = _fp32(sketch_rank, distribution)
    assert not torch.equal(fp32.to(torch.bfloat16).float(), fp32)


def test_layer_sketch_holds_one_projection_and_serves_its_dtype_without_a_copy():
    buffer = FlatSketchBuffer([SketchSlot("k", rows=8, sketch_rank=16, tp_partial=False)],
                              device="cpu")
    held = _fp32(16, "rademacher").to(torch.bfloat16)
    sketch = LayerSketch("k", held, buffer)
    assert sketch.projection_as(torch.bfloat16) is held
    assert sketch.projection_as(torch.bfloat16) is held  # no cache beside it either
    assert vars(sketch).keys() == {"layer_key", "buffer", "projection"}
    # Another dtype is a transient cast with the same values (exact: they are bf16 values).
    assert torch.equal(sketch.projection_as(torch.float32), held.float())


def test_norm_block_rows_bound_the_float64_temporary():
    assert norm_block_rows(3584) * 3584 <= NORM_BLOCK_ELEMENTS
    assert norm_block_rows(NORM_BLOCK_ELEMENTS * 2) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_sq_norm_equals_the_float64_reference_to_summation_order(dtype):
    """Squares of fp32 / bf16 values are exact in float64, so the blockwise sum and the
    reference differ only in the order of additions of n positive terms: at most
    ``(n - 1) u`` relative, u the float64 unit roundoff."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(301, 70, generator=generator) * 3.0).to(dtype)
    reference = weight.double().pow(2).sum()
    bound = (weight.numel() - 1) * FLOAT64_UNIT_ROUNDOFF
    for rows in (1, 7, 64, 301):
        got = blockwise_sq_norm(weight.split(rows))
        assert got.dtype == torch.float64
        assert abs(float(got) - float(reference)) <= bound * float(reference), rows
    assert torch.equal(blockwise_sq_norm([weight]), reference)


def test_blockwise_sq_norm_refuses_no_blocks_naming_the_fix():
    with pytest.raises(ValueError, match="row blocks"):
        blockwise_sq_norm([])
