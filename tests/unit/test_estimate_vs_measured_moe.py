"""The whole-model memory estimate of an MoE GPT against the measured peak of its own step.

tools/estimate_vs_measured.py with ``--experts`` (one process, CPU, fp32, ``sdpa``): the run's
own MoE model and optimizer (Megatron's MoE layer, ``SequentialMLP`` experts over the
sketch-capable linears) beside :func:`megatron_logra.memory.from_config.estimate_for_config`
of the same config, for dense Adam and LoGRA (library mode; paper mode, LoRA and bf16 LoGRA
are refused for MoE by the trainer), per recompute mode. Two bench models:

* ``routed``: every layer MoE, 4 experts top-2, no shared expert, q/k norms (the Qwen3-MoE
  layout);
* ``shared``: layer 0 MoE with a gated shared expert and pre-softmax routing (the Qwen2-MoE
  layout), layer 1 dense (``moe_layer_freq=2``);
* ``qk_bf16``: a dense GPT with q/k norms in bf16 (whose fp32 copies of q and k the norms
  keep: the one q/k norm term that fp32 does not show).

At this size the MoE layer's own terms (router and dispatch maps, the k T routed copies'
activations, the backward's routed-token gradients) are a quarter to a half of the peak, so
dropping one of them moves a configuration past the tolerance.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.torchrun import REPO, torchrun_env

TOLERANCE = 0.10
"""The issue's claim for the estimator: |estimate / measured peak - 1| <= 10%."""
BASE = ["--layers", "2", "--hidden", "64", "--ffn", "128", "--heads", "4", "--vocab", "128",
        "--rank", "8", "--seq-lengths", "256"]
MODELS = {
    "routed": ["--experts", "4", "--topk", "2", "--expert-ffn", "48", "--qk-layernorm"],
    "shared": ["--experts", "4", "--topk", "2", "--expert-ffn", "48", "--shared-ffn", "64",
               "--moe-layer-freq", "2", "--router-pre-softmax", "--shared-gate"],
    "qk_bf16": ["--qk-layernorm"],
}
# sdpa keeps nothing quadratic: selective recompute differs from none only in what the
# rebuilt core attention frees, measured once on the routed model.
CONFIGS = {"routed": ("fp32:sdpa:none", "fp32:sdpa:selective", "fp32:sdpa:full"),
           "shared": ("fp32:sdpa:none", "fp32:sdpa:full"),
           "qk_bf16": ("bf16:sdpa:none", "bf16:sdpa:full")}
METHODS = ("dense_adam", "logra")
CASES = [(model, config, method) for model in MODELS for config in CONFIGS[model]
         for method in METHODS]


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, str, str], dict]:
    out = {}
    for model, flags in MODELS.items():
        done = subprocess.run(
            [sys.executable, "-W", "ignore", str(REPO / "tools" / "estimate_vs_measured.py"),
             *BASE, *flags, "--configs", ",".join(CONFIGS[model]), "--methods", ",".join(METHODS),
             "--json"],
            env=torchrun_env(), capture_output=True, text=True, timeout=600,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        for r in json.loads(done.stdout):
            out[(model, f"{r['dtype']}:{r['attention']}:{r['recompute']}", r["method"])] = r
    return out


def test_every_moe_configuration_was_measured(rows):
    assert sorted(rows) == sorted(CASES)


@pytest.mark.parametrize(("model", "config", "method"), CASES)
def test_moe_estimate_is_within_ten_percent_of_the_measured_peak(rows, model, config, method):
    row = rows[(model, config, method)]
    measured, estimate = row["measured"]["peak_bytes"], row["estimate"]["total_bytes"]
    assert abs(estimate / measured - 1) <= TOLERANCE, (model, config, method, measured,
                                                       estimate)


def test_the_moe_terms_are_a_quarter_of_the_routed_models_measured_peak(rows):
    """The claim above has teeth: the MoE layers' own terms in the routed bench model (LoGRA,
    no recompute) are more than twice the tolerance of its measured peak."""
    from megatron_logra.memory import moe_layer
    from megatron_logra.memory.shapes import Layout, ModelShape, MoESpec

    shape = ModelShape(name="routed", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                       num_attention_heads=4, num_query_groups=4, head_dim=16, vocab_size=128,
                       make_vocab_size_divisible_by=1, qk_norm=True,
                       moe=MoESpec(num_experts=4, topk=2, expert_ffn_hidden_size=48))
    layout = Layout(seq_length=256, attention="sdpa", recompute="none")
    modes = dict.fromkeys(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), "sketched")
    terms = moe_layer.moe_mlp_terms(shape, layout, element_bytes=4, linear_modes=modes, rank=8,
                                    norms_trained=True)
    own = sum(v for k, v in terms.items() if k != "pre_mlp_norm")
    own_total = 2 * own + moe_layer.moe_backward_temporaries(shape, layout, 4)
    measured_peak = rows[("routed", "fp32:sdpa:none", "logra")]["measured"]["peak_bytes"]
    assert own_total > 0.25 * measured_peak, (own_total, measured_peak)
