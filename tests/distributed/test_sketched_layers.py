"""Sketched Megatron linears on real Megatron-Core layers over gloo (DESIGN section 6, rungs 1-2).

One torchrun job per layout runs ``workers/sketched_layers_worker.py``, which measures and writes
JSON; each test below asserts one claim on those measurements. Layouts: TP=1; TP=2 (column
shards own rows, row shards own input columns and produce partial sketches); TP=2 with sequence
parallelism (the column-parallel input is sequence-sharded and P, not X, is gathered); and
TP=2 x DP=2 on four processes (the DDP buffer check with data parallelism).
"""

from __future__ import annotations

import pytest

from tests.layouts import WORKER_LAYOUTS as LAYOUTS
from tests.layouts import worker_result
from tests.torchrun import WORKERS

pytestmark = pytest.mark.distributed

# float64 end to end: the sketch and G A^T differ only in summation order over ~32 tokens and
# the TP all-reduce of row-parallel partials; observed ~1e-15 relative.
SKETCH_REL_TOL_FP64 = 1e-12
# The input-gradient path of a sketched layer is Megatron's own arithmetic (H W); observed 0.
INPUT_GRAD_REL_TOL_FP64 = 1e-12
FP32_BYTES = 4



@pytest.fixture(params=sorted(LAYOUTS))
def measured(request, tmp_path_factory) -> dict:
    return worker_result(request.param, WORKERS / "sketched_layers_worker.py", tmp_path_factory)


def test_sketch_equals_dense_gradient_times_projection_transpose(measured):
    errors = measured["sketch"]["sketch_rel_err"]
    assert errors["column"] < SKETCH_REL_TOL_FP64, errors
    assert errors["row"] < SKETCH_REL_TOL_FP64, errors


def test_sketching_leaves_loss_and_input_gradients_unchanged(measured):
    sketch = measured["sketch"]
    assert sketch["loss_rel_err"] < INPUT_GRAD_REL_TOL_FP64
    assert sketch["input_grad_rel_err"] < INPUT_GRAD_REL_TOL_FP64


def test_target_weights_get_no_grad_and_no_main_grad(measured):
    no_dense = measured["sketch"]["no_dense_grad"]
    assert no_dense["num_targets"] == 8
    assert not no_dense["any_grad"]
    assert not no_dense["any_main_grad"]


def test_autograd_saves_projected_input_not_input_for_target_layers(measured):
    layout = measured["layout"]
    tokens, sketch_rank, tp = layout["tokens"], layout["sketch_rank"], layout["tp"]
    for dense, sketched in zip(measured["saved"]["dense"], measured["saved"]["sketched"],
                               strict=True):
        # Under SP a column-parallel layer receives (and keeps) only its sequence shard.
        local_tokens = tokens // tp if (layout["sp"] and dense["kind"] == "column") else tokens
        assert dense["bytes"] == local_tokens * dense["in_local"] * FP32_BYTES, dense
        assert sketched["bytes"] == local_tokens * sketch_rank * FP32_BYTES, sketched
        assert all(shape[-1] == sketch_rank for shape in sketched["shapes"]), sketched


def test_sketch_reduction_is_one_collective_per_buffer_segment(measured):
    """Complete sketches are summed over DP, row-parallel partials over TP x DP: at most one
    collective per segment of the flat buffer, none per layer, each covering the buffer once."""
    layout, reduction = measured["layout"], measured["sketch"]["reduction"]
    expected = (1 if layout["dp"] > 1 else 0) + (1 if layout["tp"] > 1 else 0)
    assert reduction["num_collectives"] == expected, reduction
    assert reduction["all_on_flat_buffer"], reduction
    if layout["dp"] > 1:
        assert reduction["elements_reduced"] == reduction["buffer_elements"], reduction
    elif layout["tp"] > 1:
        # DP=1: only the row-parallel partials need summing (over TP).
        assert reduction["elements_reduced"] == reduction["partial_elements"], reduction


def test_ddp_grad_buffer_excludes_sketched_weights(measured):
    for mode, ddp in measured["ddp"].items():
        assert ddp["num_targets"] == 8, mode
        assert ddp["targets_in_buffer"] == 0, mode
        assert ddp["buffer_params_are_trainable_params"], mode
    # Without the distributed optimizer the buffer has no alignment padding: exactly the
    # non-target parameters.
    plain = measured["ddp"]["distopt_False"]
    assert plain["buffer_numel_unpadded"] == plain["trainable_numel"]


def test_recomputed_layers_run_forward_twice_per_microbatch(measured):
    """Guards the next test: recompute really re-runs the modules it covers (2 microbatches)."""
    recompute = measured["recompute"]
    assert recompute["none"]["forwards"] == {"linear_qkv": 2, "core_attention": 2}
    for mode in ("full_uniform", "full_block"):
        assert recompute[mode]["forwards"] == {"linear_qkv": 4, "core_attention": 4}, mode
    assert recompute["selective"]["forwards"] == {"linear_qkv": 2, "core_attention": 4}


def test_recompute_accumulates_each_sketch_once_per_microbatch_and_changes_nothing(measured):
    # The recomputed forward repeats the same operations on the same inputs: bit-identical.
    for mode in ("full_uniform", "full_block", "selective"):
        result = measured["recompute"][mode]
        assert result["accumulations_per_layer"] == [2], (mode, result)
        assert result["layers"] == 8, (mode, result)
        assert result["sketch_max_abs_diff"] == 0.0, (mode, result)
        assert result["embedding_grad_max_abs_diff"] == 0.0, (mode, result)
        assert result["loss_abs_diff"] == 0.0, (mode, result)


def test_full_recompute_gives_dense_and_lora_models_the_same_gradients(measured):
    # LoRA freezes the embedding: the reentrant recompute reaches the adapters only through
    # the embedding-output anchor (mcore/models/grad_anchor.py).
    for method in ("dense", "lora"):
        result = measured["recompute"][f"{method}_full_uniform"]
        assert result["num_grads"] == result["num_trainable"] > 0, (method, result)
        assert result["grad_max_abs_diff"] == 0.0, (method, result)
