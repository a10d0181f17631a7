"""The three exact-master stores of bf16 weights through the real CLI (issue [below-lora] 1-2).

``logra.master_weights`` = ``dp_sharded`` (fp32 rows on the device), ``remainder`` (int16 low
halves beside the bf16 weight) and ``host`` (fp32 rows in host memory, merged in row chunks)
compute the same fp32 update of the same rows and round it the same way, so at TP=2 x DP=2 over
20 steps their losses and weights are *bit-identical*, not merely close. Their checkpoints hold
fp32 rows in every mode, so a run saved in one mode resumes in another on the same trajectory:
here dp_sharded -> remainder and remainder -> host (whose merge takes linear_qkv's owned rows in
two chunks), each resuming the step-10 checkpoint of the 20-step run of the first mode (four
4-process jobs in all, the last two of 10 steps). The
per-rank state shows each store's device bytes (4, 2 and 0 per owned target element) and the
host store's bytes counted apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_logra.merge_chunks import MIB, host_chunk_rows, min_host_chunk_mib
from megatron_logra.row_sharding import RowShard
from megatron_logra.train.metrics import read_metrics
from tests.cli_runs import CliRuns
from tests.layouts import SP, TP2
from tests.presets import SWIGLU_RMSNORM_NO_BIAS, tiny_gpt
from tests.torchrun import REPO

pytestmark = pytest.mark.distributed

CONFIG = REPO / "configs" / "demo_cpu.yaml"
STEPS = 20
SWITCH_AFTER = 10
PROCESSES = 4  # TP=2 x DP=2
# Wide enough that a target's owned rows hold several host chunks: linear_qkv's 3 x 512 rows
# are 768 per TP rank and 384 per DP rank, two groups of 192 (the host chunk's row alignment).
# One layer (it has every target) of 16 tokens keeps the four jobs near the narrow model's time.
HIDDEN = 512
BASE = [
    "parallel.device=cpu", *tiny_gpt(num_layers=1, hidden_size=HIDDEN, seq_length=16),
    *SWIGLU_RMSNORM_NO_BIAS, *TP2, *SP,
    "model.params_dtype=bf16", f"train.steps={STEPS}", "train.global_batch_size=8",
    "train.micro_batch_size=4", "optimizer.name=logra", "optimizer.lr=0.002",
    "optimizer.weight_decay=0.01", "optimizer.lr_warmup_steps=0", "logra.sketch_rank=16",
    "run.save_full_weights=true",
]
# The smallest budget (one group of 192 fp32 rows of the widest target, linear_qkv's 512
# columns): two chunks per owned linear_qkv block, so the chunk loop is exercised (asserted below).
HOST_CHUNK_MIB = min_host_chunk_mib(HIDDEN)
MODES = {
    "dp_sharded": ["logra.master_weights=dp_sharded"],
    "remainder": ["logra.master_weights=remainder"],
    "host": ["logra.master_weights=host", f"logra.merge_chunk_mib={HOST_CHUNK_MIB}"],
}
TARGET_SUFFIXES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
                   "linear_fc2.weight")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic_data_dir) -> CliRuns:
    return CliRuns(tmp_path_factory.mktemp("master_modes"), "train", CONFIG, BASE,
                   synthetic_data_dir)


def _run(runs: CliRuns, mode: str) -> Path:
    """The 20-step run of a mode, checkpointed at step 10 (and at the end)."""
    return runs.run(mode, PROCESSES, [*MODES[mode], f"checkpoint.interval={SWITCH_AFTER}"],
                    checkpointed=True)


def _switched(runs: CliRuns, first: str, second: str) -> Path:
    _run(runs, first)
    return runs.forked(f"{first}_then_{second}", first, SWITCH_AFTER, (PROCESSES, MODES[second]))


def _assert_bit_identical(candidate: Path, reference: Path) -> None:
    got, want = read_metrics(candidate / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    w_got = torch.load(candidate / "full_weights.pt")
    w_want = torch.load(reference / "full_weights.pt")
    assert sorted(w_got) == sorted(w_want)
    differing = [name for name in w_want if not torch.equal(w_got[name], w_want[name])]
    assert not differing, differing


def test_the_host_store_merges_a_target_block_in_several_chunks(runs):
    """What the bit-identity claims below cover: linear_qkv's owned rows of one TP and DP rank
    (one block: its partition stride is 1) span more than one host chunk."""
    qkv = torch.load(_run(runs, "dp_sharded") / "full_weights.pt")[
        "decoder.layers.0.self_attention.linear_qkv.weight"]
    owned = RowShard(qkv.shape[0] // 2, stride=1, dp_size=2, dp_rank=0).chunk_rows  # TP=2, DP=2
    chunk = host_chunk_rows(int(HOST_CHUNK_MIB * MIB), qkv.shape[1])
    assert chunk > 0 and owned // chunk >= 2, (owned, chunk)


def test_remainder_master_trains_bit_identically_to_fp32_device_masters(runs):
    _assert_bit_identical(_run(runs, "remainder"), _run(runs, "dp_sharded"))


@pytest.mark.parametrize(("first", "second"), [("dp_sharded", "remainder"),
                                               ("remainder", "host")])
def test_checkpoint_of_one_master_store_resumes_bit_identically_in_another(first, second, runs):
    """Steps 11-20 in ``second`` from ``first``'s checkpoint: for ``host`` also its whole
    bit-identity claim (10 merges of chunked host masters)."""
    _assert_bit_identical(_switched(runs, first, second), _run(runs, "dp_sharded"))


def _per_rank_state_bytes(run: Path) -> list[dict]:
    return json.loads((run / "state_bytes.json").read_text())["per_rank"]


def test_stores_keep_4_2_and_0_device_bytes_per_owned_target_element(runs):
    weights = torch.load(_run(runs, "dp_sharded") / "full_weights.pt")
    target_params = sum(t.numel() for name, t in weights.items()
                        if name.endswith(TARGET_SUFFIXES))
    # Every rank owns 1/(TP * DP) of the target elements (each TP shard's rows split over DP).
    owned = target_params // PROCESSES
    host_run = _switched(runs, "remainder", "host")
    per_mode = {"dp_sharded": _per_rank_state_bytes(_run(runs, "dp_sharded")),
                "remainder": _per_rank_state_bytes(_run(runs, "remainder")),
                "host": _per_rank_state_bytes(host_run)}
    for rank in range(PROCESSES):
        fp32, remainder, host = (per_mode[m][rank] for m in ("dp_sharded", "remainder", "host"))
        assert fp32["optimizer_state"] - remainder["optimizer_state"] == 2 * owned
        assert fp32["optimizer_state"] - host["optimizer_state"] == 4 * owned
        assert host["host_optimizer_state"] == 4 * owned
        assert fp32["host_optimizer_state"] == remainder["host_optimizer_state"] == 0
        assert fp32["weights"] == remainder["weights"] == host["weights"]


def test_every_step_reports_its_merge_time_beside_the_step_time(runs):
    for run in (_run(runs, "dp_sharded"), _run(runs, "remainder"),
                _switched(runs, "remainder", "host")):
        for record in read_metrics(run / "metrics.jsonl"):
            assert 0.0 < record["master_merge_time_s"] < record["step_time_s"], (run, record)
