"""``model.attention=sdpa`` (the default) computes what Megatron's ``DotProductAttention`` does.

Two torchrun jobs run ``workers/attention_worker.py``: TP=1 (one process) and TP=2 with sequence
parallelism (two processes), both with grouped-query attention (4 heads, 2 query groups). Each
test asserts one claim on the JSON they write: the whole model's logits and input gradients,
and the core-attention module itself under the three masks Megatron passes it (causal prefill,
the sampler's explicit padding mask, a KV-cache decode row); at TP=1 also the bytes autograd
saves in core attention from 1k to 8k tokens (the live-tensor tracker).
"""

from __future__ import annotations

import pytest

from tests.layouts import worker_result
from tests.torchrun import WORKERS

pytestmark = pytest.mark.distributed

LAYOUTS = ("tp1", "tp2_sp")
# Both compute softmax(Q K^T / sqrt(d)) V, in a different order (the fused kernel's online
# softmax over key blocks vs scores-then-softmax): float64 rounding only, measured 1e-16 to 9e-16.
REL_TOL_FP64 = 1e-13
# The same in float32 through two layers and the output layer: measured 1.3e-7 to 2.9e-7.
REL_TOL_FP32 = 1e-5

# SDPA keeps its output, a per-row log-sum-exp and contiguous copies of its inputs: bytes per
# token are the same at every length (measured exactly equal, 592 B/token, 1k to 8k).
LINEAR_PER_TOKEN_REL_TOL = 0.01
# DotProductAttention keeps [b, heads, s, s] probabilities: doubling s nearly quadruples what it
# saves (measured x3.96 from 1k to 2k tokens); linear storage would give x2.
LOCAL_DOUBLING_GROWTH_MIN = 3.5



@pytest.fixture(params=LAYOUTS)
def measured(request, tmp_path_factory) -> dict:
    return _measured(request.param, tmp_path_factory)


def _measured(name: str, tmp_path_factory) -> dict:
    return worker_result(name, WORKERS / "attention_worker.py", tmp_path_factory)


def test_default_core_attention_is_sdpa(measured):
    assert measured["types"]["sdpa"] == "SDPAttention"


def test_model_logits_and_input_gradients_equal_dot_product_attention(measured):
    for dtype, tolerance in (("float64", REL_TOL_FP64), ("float32", REL_TOL_FP32)):
        errors = measured["model"][dtype]
        assert max(errors.values()) < tolerance, (dtype, errors)


def test_module_output_and_qkv_gradients_equal_dot_product_attention_under_every_mask(measured):
    for case, errors in measured["module"].items():
        assert max(errors.values()) < REL_TOL_FP64, (case, errors)


def test_sdpa_saved_attention_memory_grows_linearly_from_1k_to_8k_tokens(tmp_path_factory):
    saved = _measured("tp1", tmp_path_factory)["memory"]["sdpa"]["core_attention"]
    per_token = {int(length): nbytes / int(length) for length, nbytes in saved.items()}
    assert sorted(per_token) == [1024, 2048, 4096, 8192]
    first = per_token[1024]
    assert all(abs(v / first - 1.0) < LINEAR_PER_TOKEN_REL_TOL for v in per_token.values()), saved


def test_local_attention_saved_memory_grows_quadratically(tmp_path_factory):
    saved = _measured("tp1", tmp_path_factory)["memory"]["local"]["core_attention"]
    assert saved["2048"] / saved["1024"] > LOCAL_DOUBLING_GROWTH_MIN, saved
