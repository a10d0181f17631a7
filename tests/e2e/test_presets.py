"""The GPU presets in configs/ load, validate, keep their memory claims, and train on CPU.

Each preset's header states the launch command (8 processes), the memory estimator command and
the estimator's verdict. A preset cannot rot unnoticed:

* it validates at the layout of its launch command (8 processes);
* the estimator command in its header reproduces the verdict in its header;
* it runs one LoGRA step, and saves a checkpoint, through the real CLI on CPU at toy width: the
  model's dimensions shrink but its structure stays (norm, activation, grouped-query ratio,
  biases, tied / untied embeddings, rotary base, epsilon, bf16 parameters, sequence
  parallelism, virtual pipeline stages, optimizer and LoGRA settings), and its layout shrinks to
  at most 4 processes (tensor and pipeline parallelism kept where the preset has them).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shlex
from pathlib import Path

import pytest
import yaml

from megatron_logra.config import Config, load_config
from tests.tools import load_tool
from tests.torchrun import REPO, run_torchrun

PRESETS = ("qwen2.5-1.5b", "qwen2.5-7b", "dense-27b")
MOE_PRESETS = ("qwen3-30b-a3b",)
"""fp32 LoGRA in library mode (bf16 LoGRA, paper mode and LoRA are refused for MoE; the
header says why); its verdict has no LoRA figure."""
TOY_EXPERTS = 4
LAUNCH_RE = re.compile(r"^#\s+launch/torchrun_single_node\.sh --nproc (\d+) train (\S+)$", re.M)
ESTIMATE_RE = re.compile(r"^#\s+python (tools/memory_estimator\.py .*)$", re.M)
VERDICT_RE = re.compile(r"(LoGRA|dense Adam|LoRA r256) (yes|no) \(([\d.]+) GiB\)")
VERDICT_METHODS = {"LoGRA": "logra", "dense Adam": "dense_adam", "LoRA r256": "lora"}
# The header quotes the estimate to one decimal in GiB.
VERDICT_GIB_ROUNDING = 0.05 + 1e-9
# Toy width: 8-wide heads keep every preset's GQA ratio at a few hundred parameters per layer.
TOY_HEAD_DIM = 8
TOY_SEQ_LENGTH = 32
TOY_SKETCH_RANK = 8
# What must survive the shrink to toy width.
STRUCTURE_FIELDS = ("normalization", "activation", "position_embedding", "rotary_base",
                    "add_bias_linear", "add_qkv_bias", "untie_embeddings", "layernorm_epsilon",
                    "params_dtype")


def _path(name: str) -> Path:
    return REPO / "configs" / f"{name}.yaml"


def _header(name: str) -> str:
    return _path(name).read_text()


def _launch(name: str) -> tuple[int, str]:
    match = LAUNCH_RE.search(_header(name))
    assert match is not None, f"{name}: no launch command in the header"
    return int(match.group(1)), match.group(2)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_validates_at_its_launch_layout_as_bf16_logra_rank_256(name):
    nproc, config_arg = _launch(name)
    assert config_arg == f"configs/{name}.yaml"
    cfg = load_config(_path(name)).resolved(world_size=nproc)
    p = cfg.parallel
    assert p.tp * p.pp * p.dp == nproc
    assert cfg.model.params_dtype == "bf16"
    assert cfg.optimizer.name == "logra"
    assert cfg.logra.sketch_rank == 256


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_moe_preset_validates_at_its_launch_layout_as_fp32_logra_library_with_experts(name):
    nproc, config_arg = _launch(name)
    assert config_arg == f"configs/{name}.yaml"
    cfg = load_config(_path(name)).resolved(world_size=nproc)
    p = cfg.parallel
    assert p.tp * p.pp * p.dp == nproc and p.ep > 1
    assert (cfg.model.params_dtype, cfg.optimizer.name, cfg.logra.mode) == (
        "fp32", "logra", "library")
    assert cfg.logra.sketch_rank == 256
    assert cfg.model.num_moe_experts is not None


def _estimator_main():
    return load_tool("memory_estimator").main


@pytest.mark.parametrize("name", PRESETS + MOE_PRESETS)
def test_memory_verdict_in_the_header_is_what_the_estimator_says(name):
    header = _header(name)
    command = ESTIMATE_RE.search(header)
    assert command is not None, f"{name}: no estimator command in the header"
    argv = shlex.split(command.group(1))[1:]
    assert argv[argv.index("--config") + 1] == f"configs/{name}.yaml"
    stdout = io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(stdout):
        assert _estimator_main()([*argv, "--json"]) == 0
    methods = json.loads(stdout.getvalue())["methods"]
    verdicts = VERDICT_RE.findall(header)
    expected = [label for label, method in VERDICT_METHODS.items() if method in methods]
    assert sorted(label for label, _, _ in verdicts) == sorted(expected)
    if name in MOE_PRESETS:
        assert "lora" not in methods and "LoRA refused" in header
    for label, fits, gib in verdicts:
        estimate = methods[VERDICT_METHODS[label]]
        assert estimate["fits"] == (fits == "yes"), (name, label)
        assert abs(estimate["total_bytes"] / 1024**3 - float(gib)) <= VERDICT_GIB_ROUNDING, (
            name, label, estimate["total_bytes"] / 1024**3)
    # Every preset exists to train with LoGRA on 8 x 80 GiB.
    assert methods["logra"]["fits"]


def _toy_overrides(cfg: Config) -> tuple[int, list[str]]:
    """Processes and overrides that shrink a preset to toy width, keeping its structure."""
    m, p = cfg.model, cfg.parallel
    tp, pp = min(p.tp, 2), min(p.pp, 2)
    vpp = None if p.vpp is None else 2
    # Keep data parallelism where the model-parallel part leaves room (at most 4 processes).
    dp = 2 if tp * pp == 1 else 1
    ratio = m.num_attention_heads // m.query_groups
    groups = max(tp, 2) if m.query_groups > 1 else 1
    heads = groups * ratio
    hidden = heads * TOY_HEAD_DIM
    microbatches = max(pp, 2)
    overrides = [
        "parallel.device=cpu", f"parallel.tp={tp}", f"parallel.pp={pp}",
        f"parallel.vpp={'null' if vpp is None else vpp}",
        f"model.num_layers={pp * (vpp or 1)}", f"model.hidden_size={hidden}",
        f"model.num_attention_heads={heads}", f"model.num_query_groups={groups}",
        f"model.ffn_hidden_size={2 * hidden}", f"model.seq_length={TOY_SEQ_LENGTH}",
        f"logra.sketch_rank={TOY_SKETCH_RANK}",
        # The embedding follows the toy tokenizer, not the preset's ~150k-row checkpoint.
        "model.vocab_size=null",
        "train.steps=1", "train.micro_batch_size=1", f"train.global_batch_size={dp * microbatches}",
    ]
    if m.num_moe_experts is not None:
        # Fewer, narrower experts, split over the data-parallel ranks as the preset splits them.
        overrides += [f"model.num_moe_experts={TOY_EXPERTS}",
                      f"model.moe_router_topk={min(m.moe_router_topk, 2)}",
                      f"model.moe_ffn_hidden_size={hidden}", f"parallel.ep={min(p.ep, dp)}"]
    return tp * pp * dp, overrides


@pytest.mark.distributed
@pytest.mark.parametrize("name", PRESETS + MOE_PRESETS)
def test_preset_trains_one_logra_step_and_checkpoints_at_toy_width(
    name, synthetic_data_dir, tmp_path
):
    preset = load_config(_path(name))
    nproc, overrides = _toy_overrides(preset)
    assert nproc <= 4
    run_dir, ckpt_dir = tmp_path / "run", tmp_path / "ckpt"
    run_torchrun(nproc, ["-m", "megatron_logra", "train", str(_path(name)), *overrides,
                         f"data.dir={synthetic_data_dir}", f"run.dir={run_dir}",
                         f"checkpoint.dir={ckpt_dir}"])
    # The preset checkpoints (at the end of training at the latest): a complete checkpoint.
    assert (ckpt_dir / "iter_0000001" / "manifest.json").is_file()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]
    assert math.isfinite(records[0]["loss"]) and math.isfinite(records[0]["grad_norm"])
    assert records[0]["logra_update_count"] == 1
    # The run's resolved config (written by the trainer) kept the preset's structure.
    ran = yaml.safe_load((run_dir / "config.yaml").read_text())
    for field in STRUCTURE_FIELDS:
        assert ran["model"][field] == getattr(preset.model, field), field
    ran_groups = ran["model"]["num_query_groups"] or ran["model"]["num_attention_heads"]
    assert ran["model"]["num_attention_heads"] // ran_groups == (
        preset.model.num_attention_heads // preset.model.query_groups)
    assert ran["parallel"]["sp"] == preset.parallel.sp
    assert (ran["parallel"]["vpp"] is None) == (preset.parallel.vpp is None)
    assert ran["parallel"]["pp"] > 1 or preset.parallel.pp == 1
    assert ran["parallel"]["tp"] > 1 or preset.parallel.tp == 1
    # The optimizer and LoGRA sections as a `train` run of the preset resolves them (nested
    # sections as dicts; the KL probe's temperature is derived there), less the toy sketch rank.
    resolved = preset.resolved(_launch(name)[0], "train").to_dict()
    for section in ("optimizer", "logra"):
        kept = {k: v for k, v in ran[section].items() if k != "sketch_rank"}
        expected = {k: v for k, v in resolved[section].items() if k != "sketch_rank"}
        assert kept == expected, section
