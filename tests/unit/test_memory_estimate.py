"""The analytic memory estimator against hand-computed cases, Megatron's formula and measurement.

Models used below (all numbers in the tests are derived by hand from these shapes):

TINY_MHA: 4 layers, h = 64, F = 256 (= 4h, GeLU), 4 heads of 16 (query width = h), LayerNorm,
untied, vocabulary 1000 padded to 1024 (multiple of 128 * tp for tp = 1, 2), dropout on -- the
model Megatron's formula and Korthikanti et al.'s Table 2 assume.
    per layer: qkv 3*64*64 = 12,288; proj 64*64 = 4,096; fc1 256*64 = 16,384; fc2 16,384;
               two LayerNorms 2*2*64 = 256                               -> 49,408
    4 layers 197,632 + embeddings 2*1024*64 = 131,072 + final norm 128  -> 328,832 parameters

TINY_GQA: 2 layers, h = 64, F = 96 gated, 4 heads of 16 in 2 groups (kv width 32), RMSNorm, tied,
vocabulary 500 padded to 512, no dropout.
    per layer: qkv (64 + 2*32)*64 = 8,192; proj 4,096; fc1 2*96*64 = 12,288; fc2 96*64 = 6,144;
               two RMSNorms 128                                          -> 30,848
    2 layers 61,696 + embedding 512*64 = 32,768 + final norm 64          -> 94,528 parameters

TINY: 2 layers, h = 8, F = 16 gated, 4 heads of 2 in 2 groups (query width 8, kv width 4), RMSNorm,
qkv bias, tied, vocabulary 32 (multiple of 8 * tp), no dropout; used at tp = 2, dp = 2.
    targets [out, in] global -> TP-local:  qkv [16, 8] column -> [8, 8] = 64;
    proj [8, 8] row -> [8, 4] = 32;  fc1 [32, 8] column -> [16, 8] = 128;  fc2 [8, 16] row -> [8, 8] = 64
    per layer 288 target params, local rows 8 + 8 + 16 + 8 = 40, local input columns 8 + 4 + 8 + 8 = 28
    2 layers: targets 576, rows 80, columns 56
    non-targets: 2 * (norms 16 + qkv bias 16/2) = 48, embedding 32/2 * 8 = 128, final norm 8 -> 184
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_logra.config import TARGET_NAMES, load_config
from megatron_logra.memory.estimate import (
    GIB,
    TARGET_LINEARS,
    Layout,
    ModelShape,
    dense_adam_memory,
    layer_activation_terms,
    logra_memory,
    lora_adapter_parameters,
    lora_memory,
    megatron_formula,
    preset,
    shape_from_model_config,
    stage_activation_bytes,
    stage_parameters,
)
from tests.torchrun import REPO, torchrun_env

# Every estimate is a sum of a few dozen products of integers below 2^53 with divisions by tp,
# pp, dp and the interleaving penalty; float64 rounding leaves at most a few ulps.
FLOAT_REL_TOL = 1e-12
# Measured persistent state may exceed the estimate by what the estimator leaves out: torch
# Adam's 4-byte step counter per parameter tensor (60 B for dense Adam's 15 tensors on the demo
# model, 1.3e-5 of its optimizer state; 28 B for LoGRA's 7 non-target tensors, 1.0e-4) and DDP
# grad-buffer alignment padding (none at this size, but Megatron may pad for alignment).
UNMODELLED_STATE_REL_TOL = 1e-3

TINY_MHA = ModelShape(
    name="tiny-mha", num_layers=4, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
    num_query_groups=4, head_dim=16, vocab_size=1000, tied_embeddings=False, gated_mlp=False,
    normalization="LayerNorm", dropout=True,
)
TINY_GQA = ModelShape(
    name="tiny-gqa", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
    num_query_groups=2, head_dim=16, vocab_size=500, tied_embeddings=True, gated_mlp=True,
    normalization="RMSNorm",
)
TINY = ModelShape(
    name="tiny", num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=4,
    num_query_groups=2, head_dim=2, vocab_size=32, make_vocab_size_divisible_by=8,
    tied_embeddings=True, gated_mlp=True, qkv_bias=True,
)


def _static(b) -> float:
    return b.weights + b.gradients + b.optimizer_state


def _close(actual: float, expected: float) -> bool:
    return abs(actual - expected) <= FLOAT_REL_TOL * abs(expected)


# ----------------------------------------------------------------------------- shapes


def test_target_linears_are_the_config_target_names():
    assert TARGET_LINEARS == TARGET_NAMES


def test_presets_have_their_public_parameter_counts():
    # qwen2.5-1.5b per layer: qkv 2048*1536 = 3,145,728; proj 1536^2 = 2,359,296;
    # fc1 17,920*1536 = 27,525,120; fc2 8960*1536 = 13,762,560; qkv bias 2048; norms 3072
    # -> 46,797,824; x28 = 1,310,339,072; + tied embedding 151,936*1536 = 233,373,696 + 1536.
    assert preset("qwen2.5-1.5b").total_parameters() == 1_543_714_304
    # qwen2.5-7b per layer: qkv 4608*3584 = 16,515,072; proj 12,845,056; fc1 135,790,592;
    # fc2 67,895,296; bias 4608; norms 7168 -> 233,057,792; x28 = 6,525,618,176;
    # + untied embeddings 2 * 152,064*3584 = 1,089,994,752 + 3584.
    assert preset("qwen2.5-7b").total_parameters() == 7_615_616_512
    # gemma3-27b per layer: qkv (4096 + 2*2048)*5376 = 44,040,192; proj 4096*5376 = 22,020,096;
    # fc1 43,008*5376 = 231,211,008; fc2 115,605,504; 4 norms 21,504; q/k norms 2*128 = 256
    # -> 412,898,560; x62 = 25,599,710,720; + tied embedding: the vocabulary 262,208 is padded to
    # the next multiple of 128, 262,272, so 262,272*5376 = 1,409,974,272; + final norm 5376.
    assert preset("gemma3-27b").total_parameters() == 25_599_710_720 + 1_409_974_272 + 5376


def test_shape_from_the_demo_config_counts_the_parameters_our_model_builds():
    cfg = load_config(REPO / "configs" / "demo_cpu.yaml", ["parallel.tp=1"])
    shape = shape_from_model_config(cfg.model, vocab_size=91)
    # 2 layers of h = 128, SwiGLU F = 512, 4 heads (MHA), RMSNorm, no biases, untied, vocab 91 ->
    # 128. Per layer: qkv 3*128*128 = 49,152; proj 16,384; fc1 2*512*128 = 131,072;
    # fc2 65,536; norms 256 -> 262,400; x2 = 524,800 + embeddings 2*128*128 = 32,768 + 128.
    assert shape.total_parameters() == 557_696
    assert stage_parameters(shape, Layout()).targets == 2 * (49_152 + 16_384 + 131_072 + 65_536)


# ----------------------------------------------------------------------------- Megatron's formula


def test_megatron_formula_reimplementation_matches_hand_derivation_sequence_parallel_branch():
    layout = Layout(tp=2, dp=2, micro_batch_size=2, seq_length=32, sequence_parallel=True,
                    recompute="selective")
    ref = megatron_formula(TINY_MHA, layout, distributed_optimizer=True)
    # Parameters of the most loaded shard: (block / pp + embedding) / tp + embedding / tp
    # (untied, pp = 1) with block = 4 * 49,408 + 128 = 197,760 and embedding 1024*64 = 65,536:
    # (197,760 + 65,536 + 65,536) / 2 = 164,416; bytes/param 6 + 12/2 = 12.
    assert ref.weight_and_optimizer == 164_416 * 12
    # Activations: s*b*h = 32*2*64 = 4096; per layer 4096 * (18 + 4*256/64) = 139,264;
    # 4 layers 557,056 + ids 8*64 + embedding dropout 4096 = 561,664; output layer
    # 4096 * 4 * (1 + 1024/64) = 278,528 -> 840,192; / tp = 420,096.
    assert ref.branch == "sequence_parallel_selective"
    assert ref.per_layer_activations == 139_264 / 2
    assert ref.activations == 420_096


def test_megatron_formula_reimplementation_matches_hand_derivation_without_sp_branch():
    layout = Layout(tp=2, pp=2, dp=1, micro_batch_size=2, seq_length=32, recompute="selective",
                    num_microbatches=1)
    ref = megatron_formula(TINY_MHA, layout, distributed_optimizer=False)
    # (197,760 / 2 + 65,536) / 2 = 82,208 parameters (no output layer on the first stage), 18 B.
    assert ref.weight_and_optimizer == 82_208 * 18
    # Per layer s*b*h*(10 + 24/2) = 4096 * 22 = 90,112; x4 = 360,448; + ids 8*64*2 = 1024 +
    # dropout 4096*2 = 8192 -> 369,664; x min(1, 1/2) = 184,832; x 1.05 = 194,073.6.
    assert ref.branch == "without_sequence_parallel"
    assert ref.per_layer_activations == 90_112
    assert _close(ref.activations, 194_073.6)


# ----------------------------------------------------------------------------- dense Adam


@pytest.mark.parametrize(
    ("shape", "layout", "distributed", "params", "bytes_per_param"),
    [
        # 328,832 parameters at 6 + 12/4 = 9 bytes.
        (TINY_MHA, Layout(dp=4), True, 328_832, 9),
        # 94,528 parameters at 18 bytes (no distributed optimizer).
        (TINY_GQA, Layout(dp=2), False, 94_528, 18),
    ],
    ids=["mha_layernorm_untied_distributed", "gqa_rmsnorm_tied_gated_replicated"],
)
def test_dense_adam_state_equals_megatron_formula_on_bias_free_tp1_models(
    shape, layout, distributed, params, bytes_per_param
):
    dense = dense_adam_memory(shape, layout, distributed_optimizer=distributed)
    ref = megatron_formula(shape, layout, distributed_optimizer=distributed)
    assert _static(dense) == params * bytes_per_param
    assert _static(dense) == ref.weight_and_optimizer
    assert dense.weights == 2 * params and dense.gradients == 4 * params


def test_dense_adam_state_differs_from_megatron_formula_only_by_its_norm_approximations():
    layout = Layout(tp=2, pp=2, dp=2)
    dense = dense_adam_memory(TINY_MHA, layout, distributed_optimizer=True)
    ref = megatron_formula(TINY_MHA, layout, distributed_optimizer=True)
    # First stage, exact: 2 layers of 6144 + 2048 + 8192 + 8192 TP-local weights + 256 replicated
    # norm parameters = 24,832 each, + embedding 512*64 = 32,768 -> 82,432 parameters; 12 B each.
    assert _static(dense) == 82_432 * 12
    # Megatron divides the norms by tp (2 layers * 128 fewer) and puts a 1/pp share of the final
    # norm on this stage (128 / 2 / 2 = 32 more): 82,432 - 256 + 32 = 82,208 parameters.
    assert ref.weight_and_optimizer == 82_208 * 12
    assert _static(dense) - ref.weight_and_optimizer == (256 - 32) * 12


@pytest.mark.parametrize(
    ("layout", "in_flight"),
    [
        (Layout(tp=2, micro_batch_size=2, seq_length=32, sequence_parallel=True), 1.0),
        (Layout(tp=2, pp=2, vpp=2, micro_batch_size=2, seq_length=32, sequence_parallel=True),
         2 * (1 + 1 / 4)),
        (Layout(tp=2, pp=2, micro_batch_size=2, seq_length=32, sequence_parallel=True,
                num_microbatches=1), 1.0),
    ],
    ids=["pp1", "pp2_vpp2", "pp2_one_microbatch"],
)
def test_dense_adam_activations_equal_megatron_sp_selective_formula_but_for_replicated_token_ids(
    layout, in_flight
):
    dense = dense_adam_memory(TINY_MHA, layout)
    ref = megatron_formula(TINY_MHA, layout, distributed_optimizer=True)
    assert layout.in_flight_microbatches() == in_flight
    # Megatron divides the int64 token ids (8 bytes * 64 tokens per microbatch) by tp; every TP
    # rank holds all of them.
    assert _close(dense.activations - ref.activations, 8 * 64 * in_flight * (1 - 1 / 2))


def test_dense_adam_activations_of_sequence_parallel_selective_match_hand_computation():
    # T = 64 tokens, T_s = 32, bf16: per layer T_s * (18h + 4F) = 32 * 2176 = 69,632; 4 layers
    # 278,528; ids 8*64 = 512 + dropout mask 32*64 = 2048; final-norm and output-layer inputs
    # 2 * 2*32*64 = 8192 + fp32 softmax 4*64*1024/2 = 131,072.
    layout = Layout(tp=2, micro_batch_size=2, seq_length=32, sequence_parallel=True)
    assert dense_adam_memory(TINY_MHA, layout).activations == 278_528 + 2560 + 8192 + 131_072


@pytest.mark.parametrize(
    ("recompute", "sequence_parallel", "korthikanti_sbh_factor"),
    [
        # Table 2 of Korthikanti et al. 2022 with s*b*h = 4096, a*s/h = 4*32/64 = 2, t = 2.
        ("none", False, 10 + 24 / 2 + 5 * 2 / 2),
        ("none", True, 34 / 2 + 5 * 2 / 2),
        ("selective", False, 10 + 24 / 2),
        ("selective", True, 34 / 2),
        ("full", False, 2),
        ("full", True, 2 / 2),
    ],
)
def test_per_layer_activations_reduce_to_korthikanti_table_2(
    recompute, sequence_parallel, korthikanti_sbh_factor
):
    layout = Layout(tp=2, micro_batch_size=2, seq_length=32, sequence_parallel=sequence_parallel,
                    recompute=recompute)
    acts = stage_activation_bytes(TINY_MHA, layout, element_bytes=2,
                                  linear_modes=dict.fromkeys(TARGET_LINEARS, "dense"))
    assert _close(acts.per_layer, 4096 * korthikanti_sbh_factor)


def test_full_recompute_holds_layer_inputs_plus_one_recomputed_layer():
    layout = Layout(tp=2, micro_batch_size=2, seq_length=32, sequence_parallel=True,
                    recompute="full")
    acts = stage_activation_bytes(TINY_MHA, layout, element_bytes=2,
                                  linear_modes=dict.fromkeys(TARGET_LINEARS, "dense"))
    # 4 layer inputs of 2*32*64 = 4096 B; the recomputed layer as with recompute "none" under
    # SP: s*b*h*(34/t + 5as/(ht)) = 4096 * 22 = 90,112.
    assert acts.layers == 4 * 4096
    assert acts.recomputed_layer == 90_112


# ----------------------------------------------------------------------------- LoRA and LoGRA


TINY_LAYOUT = Layout(tp=2, dp=2, micro_batch_size=1, seq_length=4, sequence_parallel=True)


def test_tiny_model_stage_parameters_match_hand_count():
    params = stage_parameters(TINY, TINY_LAYOUT)
    assert (params.targets, params.non_targets) == (576, 184)
    # Adapters of rank 2: qkv 2*(8 + 8) = 32, proj 2*(4 + 8) = 24, fc1 2*(8 + 16) = 48,
    # fc2 2*(8 + 8) = 32 -> 136 per layer, 272 in all.
    assert lora_adapter_parameters(TINY, TINY_LAYOUT, 2) == 272


def test_lora_static_memory_of_tiny_model_matches_hand_computation():
    lora = lora_memory(TINY, TINY_LAYOUT, lora_rank=2, precision="bf16")
    # bf16 base of 760 parameters and bf16 adapters of 272; fp32 grads and Adam state (sharded
    # over dp = 2) for the adapters only.
    assert (lora.weights, lora.gradients, lora.optimizer_state) == (2 * 760 + 2 * 272, 4 * 272,
                                                                   12 * 272 / 2)
    assert lora.sketches == lora.projections == 0


@pytest.mark.parametrize(
    ("precision", "distributed", "non_targets", "expected"),
    [
        # bf16 weights 2*760; non-target fp32 grads 4*184; non-target Adam 12*184/2 = 1104 +
        # target masters 4*576/2 = 1152 + row moments 4*80/2 = 160; sketches 4*80*2;
        # projections held once in bf16, 2*2*56.
        ("bf16_sharded_master", True, "adam", (1520, 736, 1104 + 1152 + 160, 640, 224)),
        # fp32 everywhere: weights 4*760; grads 4*184; m + v 8*184 + row moments 4*80;
        # projections 4*2*56.
        ("fp32", False, "adam", (3040, 736, 1472 + 320, 640, 448)),
        # The paper's mode: non-targets frozen, so no grads and no Adam.
        ("bf16_sharded_master", True, "frozen", (1520, 0, 1152 + 160, 640, 224)),
    ],
    ids=["bf16_sharded_library", "fp32_library", "bf16_sharded_frozen"],
)
def test_logra_static_memory_of_tiny_model_matches_hand_computation(
    precision, distributed, non_targets, expected
):
    logra = logra_memory(TINY, TINY_LAYOUT, sketch_rank=2, precision=precision,
                         distributed_optimizer=distributed, non_targets=non_targets)
    got = (logra.weights, logra.gradients, logra.optimizer_state, logra.sketches,
           logra.projections)
    assert got == expected


@pytest.mark.parametrize(
    ("precision", "gpu_masters", "host_masters"),
    [
        # 576 target params over dp = 2: fp32 rows 4*576/2, int16 remainders 2*576/2, or fp32
        # rows in host memory (0 on the GPU).
        ("bf16_sharded_master", 1152, 0),
        ("bf16_remainder", 576, 0),
        ("bf16_host_master", 0, 1152),
    ],
)
def test_each_master_mode_keeps_its_bytes_per_owned_target_element_on_the_gpu_or_host(
    precision, gpu_masters, host_masters
):
    """Only the master differs between the modes: the rest of the bf16 library case above
    (non-target Adam 1104 + row moments 160), and host bytes stay out of the GPU total."""
    logra = logra_memory(TINY, TINY_LAYOUT, sketch_rank=2, precision=precision)
    fp32_rows = logra_memory(TINY, TINY_LAYOUT, sketch_rank=2, precision="bf16_sharded_master")
    assert logra.optimizer_state == 1104 + 160 + gpu_masters
    assert logra.host_optimizer_state == host_masters
    assert fp32_rows.total - logra.total == 1152 - gpu_masters
    assert logra.as_dict()["host_optimizer_state_bytes"] == host_masters


def test_sketched_layers_save_projected_inputs_instead_of_exactly_the_four_target_inputs():
    # TINY at tp = 2 with SP, T = 4 tokens, T_s = 2, bf16, rank 2. Dense terms per layer:
    dense_terms = {
        "input_norm_input": 2 * 2 * 8,
        "linear_qkv_input": 2 * 2 * 8,  # local sequence shard of the norm output
        "core_attention_qkv": 2 * 4 * (8 + 2 * 4) / 2,
        "linear_proj_input": 2 * 4 * 4,  # all tokens, 8/2 local columns of the context
        "pre_mlp_norm_input": 2 * 2 * 8,
        "linear_fc1_input": 2 * 2 * 8,
        "activation_input": 2 * 4 * 32 / 2,
        "linear_fc2_input": 2 * 4 * 8,
    }
    sketched = {
        **{k: v for k, v in dense_terms.items() if not k.startswith("linear_")},
        "linear_qkv_lowrank": 2 * 2 * 2,  # P [T_s, r] from the local shard
        "linear_proj_lowrank": 2 * 4 * 2,  # P [T, r] from the local columns
        "linear_fc1_lowrank": 2 * 2 * 2,
        "linear_fc2_lowrank": 2 * 4 * 2,
    }
    lora = {**dense_terms, **{f"{n}_lowrank": 2 * 2 * 2 for n in TARGET_LINEARS}}

    def terms(mode: str) -> dict[str, float]:
        return layer_activation_terms(TINY, TINY_LAYOUT, element_bytes=2, rank=2,
                                      linear_modes=dict.fromkeys(TARGET_LINEARS, mode))

    assert terms("dense") == dense_terms
    assert terms("sketched") == sketched
    assert terms("lora") == lora


def test_stage_activations_of_tiny_model_match_hand_computation():
    # Per layer: dense 416 B, sketched 416 - 160 + 48 = 304 B, LoRA 416 + 32 = 448 B (above).
    # Stage extras: token ids 8*4 = 32 (only if the embedding trains); final-norm input 32;
    # output-layer input 32 (only if it trains); fp32 softmax 4*4*32/2 = 256.
    dense = dense_adam_memory(TINY, TINY_LAYOUT).activations
    library = logra_memory(TINY, TINY_LAYOUT, sketch_rank=2).activations
    paper = logra_memory(TINY, TINY_LAYOUT, sketch_rank=2, non_targets="frozen").activations
    lora = lora_memory(TINY, TINY_LAYOUT, lora_rank=2).activations
    assert dense == 2 * 416 + 32 + 32 + 32 + 256
    assert library == 2 * 304 + 32 + 32 + 32 + 256
    assert paper == 2 * 304 + 32 + 256
    assert lora == 2 * 448 + 32 + 256


@pytest.mark.parametrize(
    ("layout", "lora_precision", "logra_precision", "non_targets"),
    [
        # fp32 parameter storage for both methods (the paper's setting), one GPU to one node.
        (Layout(dp=1), "fp32", "fp32", "adam"),
        (Layout(dp=1), "fp32", "fp32", "frozen"),
        (Layout(dp=8), "fp32", "fp32", "adam"),
        (Layout(dp=8), "fp32", "fp32", "frozen"),
        # Megatron bf16 on one 8-GPU node, non-targets frozen as LoRA freezes them.
        (Layout(dp=8), "bf16", "bf16_sharded_master", "frozen"),
    ],
    ids=["fp32_dp1_library", "fp32_dp1_paper", "fp32_dp8_library", "fp32_dp8_paper",
         "bf16_dp8_paper"],
)
def test_logra_persistent_state_is_below_rank_256_lora_for_qwen2_5_1_5b(
    layout, lora_precision, logra_precision, non_targets
):
    shape = preset("qwen2.5-1.5b")
    lora = lora_memory(shape, layout, lora_rank=256, precision=lora_precision)
    logra = logra_memory(shape, layout, sketch_rank=256, precision=logra_precision,
                         non_targets=non_targets)
    assert logra.persistent < lora.persistent


def test_dense_adam_does_not_fit_gemma3_27b_on_four_80_gib_gpus_and_logra_does():
    layout = Layout(tp=4, sequence_parallel=True, seq_length=4096, recompute="full")
    shape = preset("gemma3-27b")
    assert dense_adam_memory(shape, layout).total > 80 * GIB
    assert logra_memory(shape, layout).total < 80 * GIB


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Layout(tp=0), "Layout.tp=0"),
        (lambda: Layout(recompute="some"), "Layout.recompute='some'"),
        (lambda: Layout(sequence_parallel=True), "Layout.sequence_parallel=True"),
        (lambda: Layout(pp=1, vpp=2), "Layout.vpp=2"),
        (lambda: stage_parameters(TINY, Layout(tp=4)), "num_query_groups=2"),
        (lambda: stage_parameters(TINY_MHA, Layout(pp=3)), "num_layers=4"),
        (lambda: logra_memory(TINY, Layout(), precision="bf16"), "precision='bf16'"),
        (lambda: lora_memory(TINY, Layout(), lora_rank=0), "lora_rank=0"),
        (lambda: logra_memory(TINY, Layout(), targets=("q_proj",)), "'q_proj'"),
        (lambda: ModelShape(name="x", num_layers=1, hidden_size=8, ffn_hidden_size=8,
                            num_attention_heads=3, num_query_groups=2, head_dim=2,
                            vocab_size=8), "num_attention_heads=3"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument_and_value(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


# ----------------------------------------------------------------------------- measured state


def _train_one_step(optimizer: str, data_dir: Path, run_dir: Path) -> dict[str, int]:
    command = [
        sys.executable, "-m", "megatron_logra", "train", "configs/demo_cpu.yaml",
        "parallel.tp=1", "train.steps=1", f"run.dir={run_dir}", f"optimizer.name={optimizer}",
        f"data.dir={data_dir}",
    ]
    result = subprocess.run(command, cwd=REPO, env=torchrun_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (rank0,) = json.loads((run_dir / "state_bytes.json").read_text())["per_rank"]
    return rank0


@pytest.mark.parametrize("optimizer", ["logra", "adam"])
def test_estimated_fp32_persistent_state_matches_measured_state_bytes_of_the_demo_model(
    optimizer, synthetic_data_dir, tmp_path
):
    measured = _train_one_step(optimizer, synthetic_data_dir, tmp_path / optimizer)
    cfg = load_config(REPO / "configs" / "demo_cpu.yaml", ["parallel.tp=1"])
    vocab = json.loads((synthetic_data_dir / "meta.json").read_text())["vocab_size"]
    shape = shape_from_model_config(cfg.model, vocab_size=vocab)
    layout = Layout(micro_batch_size=cfg.train.micro_batch_size, seq_length=cfg.model.seq_length)
    if optimizer == "logra":
        est = logra_memory(shape, layout, sketch_rank=cfg.logra.sketch_rank, precision="fp32",
                           distributed_optimizer=False)
    else:
        est = dense_adam_memory(shape, layout, precision="fp32", distributed_optimizer=False)
    # Nothing unmodelled lives in these three: they must agree to the byte.
    assert measured["weights"] == est.weights
    assert measured["sketches"] == est.sketches
    assert measured["projections"] == est.projections
    for measured_key, estimate in (("grads", est.gradients),
                                   ("optimizer_state", est.optimizer_state)):
        excess = measured[measured_key] - estimate
        assert 0 <= excess <= UNMODELLED_STATE_REL_TOL * estimate, (measured_key, measured, est)


# ----------------------------------------------------------------------------- CLI


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "tools/memory_estimator.py", *args], cwd=REPO,
                            env=torchrun_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def test_cli_json_reports_the_three_methods_with_breakdowns_and_fit_answers():
    out = json.loads(_cli("--preset", "gemma3-27b", "--tp", "4", "--seq-length", "4096",
                          "--recompute", "full", "--gpu-mem-gib", "80", "--json").stdout)
    layout = Layout(tp=4, sequence_parallel=True, seq_length=4096, recompute="full")
    shape = preset("gemma3-27b")
    expected = {"dense_adam": dense_adam_memory(shape, layout), "lora": lora_memory(shape, layout),
                "logra": logra_memory(shape, layout)}
    assert sorted(out["methods"]) == ["dense_adam", "logra", "lora"]
    for name, breakdown in expected.items():
        got = out["methods"][name]
        assert _close(got["total_gib"], breakdown.total / GIB)
        parts = sum(got[f"{k}_gib"] for k in ("weights", "gradients", "optimizer_state",
                                              "sketches", "projections", "activations"))
        assert _close(parts, got["total_gib"])
    assert out["methods"]["dense_adam"]["fits"] is False
    assert out["methods"]["logra"]["fits"] is True


def test_cli_with_our_config_estimates_the_state_the_trainer_measures():
    out = json.loads(_cli("--config", "configs/demo_cpu.yaml", "--tp", "1", "--vocab-size", "91",
                          "--json").stdout)
    logra = out["methods"]["logra"]
    # The demo model (557,696 parameters, 33,408 non-target, 3,328 target rows, 1,792 target
    # input columns, rank 16) in fp32 without the distributed optimizer: weights 4*557,696;
    # grads 4*33,408; Adam 8*33,408 + row moments 4*3,328; sketches 4*3,328*16;
    # projections 4*16*1,792.
    assert logra["weights_bytes"] == 2_230_784
    assert logra["gradients_bytes"] == 133_632
    assert logra["optimizer_state_bytes"] == 267_264 + 13_312
    assert logra["sketches_bytes"] == 212_992
    assert logra["projections_bytes"] == 114_688


def test_cli_compare_seeds_labels_estimates_and_reported_figures():
    text = _cli("--compare-seeds").stdout
    assert "ESTIMATE" in text and "REPORTED" in text
    for figure in ("7.2", "13.2", "17.3", "31.8", "OOM"):
        assert figure in text
    comparisons = json.loads(_cli("--compare-seeds", "--json").stdout)["comparisons"]
    seven_b = next(c for c in comparisons if c["model"] == "qwen2.5-7b"
                   and c["settings"]["precision"] == "bf16")
    layout = Layout(**seven_b["layout"])
    dense_row = seven_b["rows"][0]
    assert dense_row["reported"] == "31.8"
    assert _close(dense_row["estimate_gib"],
                  dense_adam_memory(preset("qwen2.5-7b"), layout).total / GIB)


# ----------------------------------------------------------------------------- the built model


def test_cli_as_built_is_the_estimate_of_the_run_the_config_describes():
    """``--as-built`` on a paper-mode KL-controlled config: the CLI's LoGRA total is
    ``estimate_for_config`` of the same config (attention, recompute, norms, probe)."""
    from megatron_logra.memory.from_config import estimate_for_config

    overrides = ["parallel.tp=1", "optimizer.name=logra", "logra.mode=paper",
                 "logra.kl_control.enabled=true", "model.recompute=full"]
    out = json.loads(_cli("--config", "configs/demo_cpu.yaml", "--vocab-size", "91",
                          *(f"--override={o}" for o in overrides), "--as-built",
                          "--json").stdout)
    cfg = load_config(REPO / "configs" / "demo_cpu.yaml", overrides).resolved(1)
    want = estimate_for_config(cfg, vocab_size=91)
    assert want.after_backward > 0  # the KL probe and the paper's norms are counted
    assert out["methods"]["logra"]["total_bytes"] == round(want.total)


def test_sdpa_keeps_activations_linear_in_sequence_length_and_local_quadratic():
    shape = shape_from_model_config(load_config(None, []).model, vocab_size=128)
    per_token = {}
    for attention in ("sdpa", "local"):
        saved = [stage_activation_bytes(
            shape, Layout(seq_length=s, recompute="none", attention=attention),
            element_bytes=4, linear_modes={}).total / s for s in (1024, 2048)]
        per_token[attention] = saved[1] / saved[0]
    assert per_token["sdpa"] == pytest.approx(1.0)
    assert per_token["local"] > 1.5  # the s x s probabilities per token double with s


def test_paper_mode_weight_norms_hold_one_float64_block_of_the_largest_target():
    from megatron_logra.memory.step_phases import paper_weight_norm_bytes
    from megatron_logra.norm_blocks import norm_block_rows

    shape = preset("qwen2.5-1.5b")
    # The largest target, fc1 (17,920 x 1,536), is summed in blocks of 2,730 rows.
    block = norm_block_rows(shape.hidden_size) * shape.hidden_size
    assert paper_weight_norm_bytes(shape, Layout(), TARGET_NAMES) == 8 * block
    # A TP=8 shard of fc1 (2,240 rows) is smaller than one block: all of it at once.
    assert paper_weight_norm_bytes(shape, Layout(tp=8), TARGET_NAMES) == 8 * (
        shape.fc1_width // 8 * shape.hidden_size)

