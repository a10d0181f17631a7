"""The rollout engine's shadow, fed the real LoGRAOptimizer's sync records, serves the trainer's
weights bit for bit.

* test_shadow_serves_the_trainers_weights_bit_for_bit_after_20_updates: one torchrun job of one
  process (the optimizer needs Megatron's process groups; one rank is the layout whose merges the
  engine replays today, docs/sync.md) trains two tiny trainers 20 updates each -- library mode
  with fp32 weights, weight decay and dense non-targets; paper mode with bf16 weights, fp32 row
  masters and bf16 factors on the wire -- and compares every served weight with torch.equal.
* test_shadow_serves_a_tp2_trainers_target_weights_bit_for_bit: one job of two processes (the
  smallest tensor-parallel layout: column-parallel rows, fc1's [gate_t; up_t] blocks and
  row-parallel column slices all occur) feeds one TP=1 shadow the combined records of both
  ranks, library mode with weight decay.
"""

from __future__ import annotations

import json

import pytest

from tests.torchrun import WORKERS, run_torchrun

pytestmark = pytest.mark.distributed

NUM_UPDATES = 20


@pytest.fixture(scope="module")
def replayed(synthetic_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sync_replay")
    run_torchrun(1, [str(WORKERS / "sync_replay_worker.py"), "--case", "sync_replay", "--out", str(out), "--data",
                     str(synthetic_data_dir), "--updates", str(NUM_UPDATES)])
    return json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("variant", ["library_fp32", "paper_bf16"])
def test_shadow_serves_the_trainers_weights_bit_for_bit_after_20_updates(replayed, variant):
    result = replayed[variant]
    assert result["update_count"] == NUM_UPDATES
    assert result["low_rank_records"] == NUM_UPDATES * result["num_targets"]
    assert result["targets_changed"] == result["num_targets"]  # the updates reached bf16 too
    assert result["unequal"] == []
    assert result["checksum_mismatches"] == []


def test_library_mode_ships_its_adam_trained_non_targets_dense_and_paper_mode_none(replayed):
    assert replayed["library_fp32"]["dense_records"] > 0
    assert replayed["paper_bf16"]["dense_records"] == 0


@pytest.fixture(scope="module")
def replayed_tp2(synthetic_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sync_replay_tp2")
    run_torchrun(2, [str(WORKERS / "sync_replay_worker.py"), "--case", "tp2", "--out", str(out),
                     "--data", str(synthetic_data_dir), "--updates", str(NUM_UPDATES)])
    return json.loads((out / "tp2.json").read_text())


def test_shadow_serves_a_tp2_trainers_target_weights_bit_for_bit(replayed_tp2):
    assert replayed_tp2["update_count"] == NUM_UPDATES
    assert replayed_tp2["low_rank_records"] == NUM_UPDATES * replayed_tp2["num_targets"]
    assert replayed_tp2["targets_changed"] == replayed_tp2["num_targets"]
    assert replayed_tp2["unequal"] == []
