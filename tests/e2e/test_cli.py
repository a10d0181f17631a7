"""The CLI refuses bad configurations before any process group work, with a clear message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.presets import tiny_width
from tests.torchrun import REPO, torchrun_env

CONFIG = str(REPO / "configs" / "demo_cpu.yaml")
# Validation happens before torch.distributed and Megatron are touched; a refusal must not pay
# for a process-group start (~3 s). Generous for a loaded CI machine.
REFUSAL_WALL_S = 30


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.tpp=2"], "unknown config key parallel.tpp"),
        (["optimizer.name=adamw"], "optimizer.name='adamw' is not valid"),
        (["logra.sketch_rank=0"], "logra.sketch_rank=0 must be > 0"),
        (["parallel.tp=3"], "model.num_attention_heads=4 must be divisible by parallel.tp=3"),
        # The demo config asks for tp=2; a plain one-process launch cannot hold it.
        ([], "world size 1 is not divisible by parallel.tp * parallel.cp * parallel.pp = 2"),
        (["parallel.tp=1", "train.global_batch_size=6"],
         "train.global_batch_size=6 must be a multiple of train.micro_batch_size * dp = 8 * 1"),
    ],
)
def test_cli_refuses_bad_config_with_exit_code_2_and_names_the_field(overrides, message):
    result = subprocess.run(
        [sys.executable, "-m", "megatron_logra", "train", CONFIG, *overrides],
        env=torchrun_env(), capture_output=True, text=True, timeout=REFUSAL_WALL_S, cwd=REPO,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr
    assert "process group" not in result.stderr.lower()


def test_train_mirrors_metrics_to_tensorboard_when_asked(synthetic_data_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_logra.train.metrics import read_metrics
    from tests.torchrun import run_torchrun

    run_dir = tmp_path / "run"
    run_torchrun(1, ["-m", "megatron_logra", "train", CONFIG, "parallel.tp=1",
                     "model.num_layers=1", *tiny_width(), "train.steps=2", f"data.dir={synthetic_data_dir}", f"run.dir={run_dir}",
                     "run.tensorboard=true"])
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("loss")]
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [step for step, _ in logged] == [1, 2]
    # TensorBoard stores float32 scalars.
    for (_, value), record in zip(logged, records, strict=True):
        assert abs(value - record["loss"]) <= 1e-6 * abs(record["loss"])


def test_train_with_lora_keeps_grads_and_adam_state_for_the_adapters_only(synthetic_data_dir,
                                                                          tmp_path):
    # optimizer.name=lora through the CLI at TP=2: the persistent state the trainer reports has
    # the adapters' exact size, Adam's two moments of them, and gradient buffers for the
    # adapters alone (the frozen base model gets none).
    import json

    from megatron_logra.train.metrics import read_metrics
    from tests.torchrun import run_torchrun

    run_dir, hidden, ffn, lora_rank = tmp_path / "run", 64, 128, 4
    run_torchrun(2, ["-m", "megatron_logra", "train", CONFIG, "parallel.tp=2",
                     "model.num_layers=1", f"model.hidden_size={hidden}",
                     "model.num_attention_heads=4", f"model.ffn_hidden_size={ffn}",
                     "model.activation=swiglu", "model.add_bias_linear=false",
                     "optimizer.name=lora", f"lora.lora_rank={lora_rank}", "optimizer.lr=0.01",
                     "train.steps=2", f"data.dir={synthetic_data_dir}", f"run.dir={run_dir}",
                     f"checkpoint.dir={tmp_path / 'ckpt'}"])
    # Full adapter elements, r * (in + out) per target: qkv (64 -> 192), proj (64 -> 64),
    # gated fc1 (64 -> 256), fc2 (128 -> 64). Over TP=2 one factor of each is split and the
    # other replicated, so the two ranks together hold each replicated factor twice.
    full = lora_rank * ((hidden + 3 * hidden) + 2 * hidden + (hidden + 2 * ffn) + (ffn + hidden))
    replicated = lora_rank * (hidden + hidden + hidden + hidden)
    adapter_bytes = 4 * (full + replicated)
    total = json.loads((run_dir / "state_bytes.json").read_text())["total"]
    assert total["adapters"] == adapter_bytes
    # torch's Adam: two moments per adapter, plus a 4-byte step counter per adapter tensor
    # (A and B of 4 targets on each of 2 ranks).
    assert total["optimizer_state"] == 2 * adapter_bytes + 4 * (2 * 4 * 2)
    # One fp32 grad-buffer slot per adapter element (no padding without the distributed
    # optimizer) and none for the base model.
    assert total["grads"] == adapter_bytes
    assert total["sketches"] == total["projections"] == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert (tmp_path / "ckpt" / "iter_0000002" / "manifest.json").is_file()
