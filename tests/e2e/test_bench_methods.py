"""tools/bench_methods.py on the tiny GPT: every model flag reaches the config key that owns it
and the built model runs it; host masters are counted apart from device state; the paper-mode
step's KL probe is timed inside the step. No timing assertion: only that the parts were measured
and lie inside their step.

Two child processes of the tool (one memory child, one timing child), the cheapest runs that
exercise each new flag once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.presets import TINY_GPT
from tests.tools import load_tool

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"
SKETCH_RANK = 8
TINY = [
    "--layers", str(TINY_GPT["num_layers"]), "--hidden", str(TINY_GPT["hidden_size"]),
    "--heads", str(TINY_GPT["num_attention_heads"]), "--ffn", str(TINY_GPT["ffn_hidden_size"]),
    "--seq-length", str(TINY_GPT["seq_length"]), "--vocab", "128",
    "--sketch-rank", str(SKETCH_RANK), "--steps", "2", "--no-kernels", "--threads", "1",
]
FP32_BYTES = 4


bench_methods = load_tool("bench_methods")


def _child(tmp_path: Path, child: str, *flags: str) -> dict:
    result = tmp_path / f"{child}.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, str(TOOLS / "bench_methods.py"), *TINY, *flags, "--child", child,
         "--result", str(result)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(result.read_text())


@pytest.fixture(scope="module")
def host_paper_memory(tmp_path_factory) -> dict:
    """Paper mode under KL control, bf16 weights with host masters, selective recompute."""
    return _child(tmp_path_factory.mktemp("bench"), "logra_paper", "--dtype", "bf16",
                  "--master-weights", "host", "--recompute", "selective")


def test_dtype_master_weights_and_recompute_flags_build_that_model(host_paper_memory):
    built = host_paper_memory["config"]
    assert built["weight_dtype"] == "torch.bfloat16"
    assert built["master_weights"] == "host"
    assert built["master_stores"] == ["HostMaster"]
    assert built["recompute_granularity"] == "selective"
    assert built["kl_control"] is True


def test_host_masters_are_counted_as_host_bytes_not_device_state(host_paper_memory):
    r = host_paper_memory
    # fp32 rows of every target (one DP rank owns them all): the estimator's count, exactly.
    assert r["host_bytes"] > 0
    assert r["host_bytes"] == r["state_bytes"]["host_optimizer_state"]
    assert r["host_bytes"] == r["estimate"]["host_bytes"]
    assert r["host_bytes"] % FP32_BYTES == 0
    assert r["device_state_bytes"] == sum(v for k, v in r["state_bytes"].items()
                                          if k != "host_optimizer_state")
    # The tracker sees a little more than state_bytes (RoPE cache, the batch), far less than
    # the masters: had they been counted as device memory, this difference would exceed them.
    assert 0 <= r["persistent_bytes"] - r["device_state_bytes"] < r["host_bytes"]
    assert bench_methods.HOST not in r["peak_by_category"]


def test_paper_step_times_its_kl_probe_inside_the_step(tmp_path, host_paper_memory):
    times = _child(tmp_path, "timing", "--attention", "local", "--recompute", "full",
                   "--methods", "lora,logra_paper")
    paper, lora = times["logra_paper"], times["lora"]
    assert "kl_probe" not in lora and "kl_realised" not in lora
    for probe, realised, wall in zip(paper["kl_probe"], paper["kl_realised"], paper["wall"],
                                     strict=True):
        assert 0 < probe and 0 < realised and probe + realised < wall
    # The report puts the share beside the step time.
    result = dict(host_paper_memory)
    bench_methods._add_times(result, paper)
    assert 0 < result["kl_share"] < 1
    args = bench_methods.build_parser().parse_args(TINY)
    table = bench_methods.format_methods({"logra_paper": result}, args, 8, 16.0, (0.0, 0.0, 0.0))
    assert "KL probe share of the step" in table and f"{result['kl_share']:.1%}" in table
    assert "host masters (measured, not device)" in table


# The estimator is calibrated to 10% of the measured peak on the models the product builds
# (tests/unit/test_estimate_vs_measured.py); the MoE columns are held to the same bound.
MOE_ESTIMATE_TOLERANCE = 0.10
# Persistent state is counted element by element on both sides (experts' sketches, projections,
# row moments, weights): they agree to the byte up to the few scalars the estimate leaves out.
MOE_PERSISTENT_TOLERANCE = 0.01


def test_moe_flags_build_routed_experts_and_the_estimate_follows_them(tmp_path):
    r = _child(tmp_path, "logra", "--methods", "logra", "--moe-experts", "4", "--moe-topk", "2",
               "--moe-ffn", "32")
    built = r["config"]
    assert built["num_moe_experts"] == 4
    assert built["local_experts"] == 4 * TINY_GPT["num_layers"]  # every layer MoE, EP=1
    # Every expert linear's own sketch, projection and moments, counted on both sides.
    state = sum(v for k, v in r["state_bytes"].items() if k != "host_optimizer_state")
    assert abs(r["estimate"]["persistent_bytes"] - state) <= MOE_PERSISTENT_TOLERANCE * state
    measured, estimated = r["peak_bytes"], r["estimate"]["total_bytes"]
    assert abs(estimated - measured) <= MOE_ESTIMATE_TOLERANCE * measured


def test_moe_with_lora_is_refused_before_any_method_runs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_methods.main([*TINY, "--moe-experts", "4"])
    assert exit_info.value.code == 2
    assert "--methods contains lora" in capsys.readouterr().err


def test_master_weights_that_do_not_fit_the_dtype_exit_2_naming_the_key(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_methods.main([*TINY, "--methods", "logra", "--master-weights", "host"])
    assert exit_info.value.code == 2
    assert "logra.master_weights=host" in capsys.readouterr().err
