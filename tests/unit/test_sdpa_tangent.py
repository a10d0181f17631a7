"""The forward-mode tangent rule of the SDPA core attention (the KL probe's path through it).

PyTorch's fused SDPA kernel has no forward-AD formula; ``sdpa_forward_ad.attention`` adds one.
Reference: ``torch.func.jvp`` of softmax attention written in plain torch ops, in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_logra.mcore.models import sdpa_forward_ad
from megatron_logra.mcore.models.sdpa_forward_ad import attention

# The rule and autograd's jvp of the reference evaluate the same formula in a different order:
# float64 rounding only (measured 1.5e-16 to 3.3e-16 relative to the largest tangent entry).
TANGENT_REL_TOL_FP64 = 1e-12
# The fused kernel (primal) and the plain-ops reference differ in summation order; measured
# 1.4e-16 to 3.7e-16.
PRIMAL_REL_TOL_FP64 = 1e-12

BATCH, HEADS, HEAD_DIM = 2, 4, 8
SCALE = HEAD_DIM**-0.5


def reference(query, key, value, allowed, is_causal, scale):
    """softmax(scale Q K^T) V in plain ops; rows with every key masked give zeros (as SDPA)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) * scale
    if is_causal:
        allowed = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    if allowed is None:
        return torch.softmax(scores, -1) @ value
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    probs = torch.where(allowed.any(-1, keepdim=True), probs, torch.zeros_like(probs))
    return probs @ value


def _rel(got, want):
    return float((got - want).abs().max() / want.abs().max())


def _case(name, generator):
    s_q, s_k, kv_heads, allowed, is_causal = {
        "causal": (12, 12, HEADS, None, True),
        "causal_gqa": (12, 12, 2, None, True),
        # A padding mask whose row 0 of sequence 0 sees no key at all (left padding).
        "mask_with_empty_row": (12, 12, 2, "padding", False),
        "decode_row": (1, 12, 2, None, False),
    }[name]
    if allowed == "padding":
        allowed = torch.ones(12, 12, dtype=torch.bool).tril().expand(BATCH, 1, 12, 12).clone()
        allowed[0, :, :, :3] = False
    def draw(s, n):
        return torch.randn(BATCH, n, s, HEAD_DIM, generator=generator, dtype=torch.float64)
    primals = (draw(s_q, HEADS), draw(s_k, kv_heads), draw(s_k, kv_heads))
    tangents = tuple(torch.randn_like(p) for p in primals)
    return primals, tangents, allowed, is_causal


# One block; blocks of a few rows (causal: growing key ranges, a ragged last block), set by
# the element budget or by the row cap; blocks of one row, the least any budget allows.
@pytest.mark.parametrize("block_elements,block_rows", [(2**24, 256), (5 * BATCH * HEADS * 12, 256),
                                                       (2**24, 5), (1, 256)])
@pytest.mark.parametrize("name", ["causal", "causal_gqa", "mask_with_empty_row", "decode_row"])
def test_tangent_of_sdpa_attention_equals_reference_jvp_in_float64(name, block_elements,
                                                                   block_rows, monkeypatch):
    monkeypatch.setattr(sdpa_forward_ad, "BLOCK_ELEMENTS", block_elements)
    monkeypatch.setattr(sdpa_forward_ad, "BLOCK_ROWS", block_rows)
    generator = torch.Generator().manual_seed(0)
    primals, tangents, allowed, is_causal = _case(name, generator)
    scale = SCALE
    with torch.no_grad(), fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(primals, tangents, strict=True)]
        unpacked = fwAD.unpack_dual(attention(*duals, allowed, is_causal, scale))
    ref_out, ref_tangent = torch.func.jvp(
        lambda q, k, v: reference(q, k, v, allowed, is_causal, scale), primals, tangents)
    assert _rel(unpacked.tangent, ref_tangent) < TANGENT_REL_TOL_FP64
    assert _rel(unpacked.primal, ref_out) < PRIMAL_REL_TOL_FP64


def test_primal_under_forward_ad_is_the_fused_kernel_output_bit_for_bit():
    primals, tangents, allowed, is_causal = _case("causal_gqa", torch.Generator().manual_seed(1))
    plain = F.scaled_dot_product_attention(*primals, is_causal=True, scale=SCALE, enable_gqa=True)
    with torch.no_grad(), fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(primals, tangents, strict=True)]
        primal = fwAD.unpack_dual(attention(*duals, allowed, is_causal, SCALE)).primal
    assert torch.equal(primal, plain)


def test_backward_of_a_forward_inside_a_dual_level_equals_the_fused_backward():
    primals, tangents, allowed, is_causal = _case("causal_gqa", torch.Generator().manual_seed(2))
    grad_out = torch.randn(BATCH, HEADS, 12, HEAD_DIM, dtype=torch.float64)
    plain = [p.clone().requires_grad_() for p in primals]
    F.scaled_dot_product_attention(*plain, is_causal=True, scale=SCALE,
                                   enable_gqa=True).backward(grad_out)
    leaves = [p.clone().requires_grad_() for p in primals]
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(leaves, tangents, strict=True)]
        attention(*duals, allowed, is_causal, SCALE).backward(grad_out)
    for got, want in zip(leaves, plain, strict=True):
        assert torch.equal(got.grad, want.grad)


class _LargestStorage(TorchDispatchMode):
    """The most elements of a new storage behind any tensor an operator returns while active
    (views count as their storage; the storages of ``given`` tensors are not new)."""

    def __init__(self, given: list[torch.Tensor]) -> None:
        super().__init__()
        self.given = {t.untyped_storage().data_ptr() for t in given}
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                if storage.data_ptr() not in self.given:
                    self.largest = max(self.largest, storage.nbytes() // value.element_size())
        return out


@pytest.mark.parametrize("is_causal", [True, False])
def test_tangent_rule_holds_no_tensor_larger_than_its_block_budget(is_causal, monkeypatch):
    """At 64 tokens, 4 query heads (2 key/value heads), a budget of 1024 elements: every
    tensor the rule makes stays within it, where one [heads, s, s] score tensor is 16384.
    (The rule only: the fused kernel of the primal may expand an explicit mask itself.)"""
    budget, s = 1024, 64
    monkeypatch.setattr(sdpa_forward_ad, "BLOCK_ELEMENTS", budget)
    generator = torch.Generator().manual_seed(3)
    shapes = ((1, 4, s, 2), (1, 2, s, 2), (1, 2, s, 2))
    primals = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    tangents = [torch.randn_like(p) for p in primals]
    allowed = None if is_causal else torch.ones(s, s, dtype=torch.bool).tril()
    mode = _LargestStorage([*primals, *tangents, *([allowed] if allowed is not None else [])])
    rule = sdpa_forward_ad._AttentionWithTangent.jvp

    def watched(*args):  # noqa: ANN002, ANN202
        with mode:
            return rule(*args)

    monkeypatch.setattr(sdpa_forward_ad._AttentionWithTangent, "jvp", staticmethod(watched))
    with torch.no_grad(), fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(primals, tangents, strict=True)]
        got = fwAD.unpack_dual(attention(*duals, allowed, is_causal, SCALE)).tangent
    assert 0 < mode.largest <= budget < 4 * s * s
    _, want = torch.func.jvp(lambda q, k, v: reference(q, k, v, allowed, is_causal, SCALE),
                             tuple(primals), tuple(tangents))
    assert _rel(got, want) < TANGENT_REL_TOL_FP64


def test_memory_estimator_bounds_the_probe_as_the_code_does():
    """The estimator (which may not import the model code) mirrors the probe's bounds."""
    from megatron_logra.mcore.kl_probe import stream
    from megatron_logra.memory import step_phases

    assert step_phases.PROBE_BLOCK_ELEMENTS == sdpa_forward_ad.BLOCK_ELEMENTS
    assert step_phases.PROBE_BLOCK_ROWS == sdpa_forward_ad.BLOCK_ROWS
    assert step_phases.PROBE_MLP_CHUNK_ELEMENTS == stream.MLP_CHUNK_ELEMENTS
    assert step_phases.KL_CHUNK_POSITIONS == stream.OUTPUT_CHUNK_POSITIONS
