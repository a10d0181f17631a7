"""The RL job with a separate rollout engine (the built-in Megatron sampler in its own processes,
engine TP=2) under a data-parallel trainer (DP=2, TP=1), kept in step by low-rank policy sync.

The engine's layout differs from the trainer's in both directions: its TP ranks hold row and
column shards of weights each trainer rank holds whole, and the trainer's DP replicas send the
same records (deduplicated). Trainer TP=2 pieces (column-parallel rows, fc1's [gate_t; up_t],
row-parallel column slices) into one engine are tested by tests/distributed/test_sync_replay.py
and by the TP=2 trainer -> vLLM TP=1 RL run of tests/distributed/test_vllm_sync.py.

One torchrun job of two trainer processes (plus the engine's own two processes) runs
``tests/distributed/workers/separate_engine_worker.py``: library-mode LoGRA with weight decay,
so every kind of record travels (column-parallel rows, fc1's [gate; up] blocks, row-parallel
column slices, Adam-trained non-targets dense), 3 RL steps with a checksum comparison after
each, then the refusals, a forced mismatch and a killed engine.

A second job runs the same with ``sync.transport=collective`` and an engine of TP=2: each
record's header over the control socket, its tensor bytes broadcast from the trainer's rank 0
to both engine ranks over a gloo group of their own.
"""

from __future__ import annotations

import json

import pytest

from tests.torchrun import WORKERS, run_torchrun

pytestmark = pytest.mark.distributed

NUM_STEPS = 3
TRAINER_TP, ENGINE_TP = 1, 2
# The engine (TP=2) and the trainer (TP=1) sum the row-parallel layers' partial products in a
# different order, so their fp32 logits differ by rounding (measured: 4.8e-7 in the log-probs
# after 3 steps with the layouts swapped, trainer TP=2 / engine TP=1). 20x that, and still
# 1000x below a step's policy change.
LOGPROB_TP_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def engine_run(synthetic_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("separate_engine")
    run_torchrun(2, [str(WORKERS / "separate_engine_worker.py"), "--case", "separate_engine",
                     "--out", str(out),
                     "--data", str(synthetic_data_dir), "--steps", str(NUM_STEPS),
                     "--trainer-tp", str(TRAINER_TP), "--engine-tp", str(ENGINE_TP)])
    return json.loads((out / "result.json").read_text())


COLLECTIVE_STEPS = 2


@pytest.fixture(scope="module")
def collective_engine_run(synthetic_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("separate_engine_collective")
    run_torchrun(2, [str(WORKERS / "separate_engine_worker.py"), "--case", "separate_engine",
                     "--out", str(out),
                     "--data", str(synthetic_data_dir), "--steps", str(COLLECTIVE_STEPS),
                     "--engine-tp", "2", "--transport", "collective"])
    return json.loads((out / "result.json").read_text())


DELTA_STEPS = 2


@pytest.fixture(scope="module")
def delta_engine_runs(synthetic_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("separate_engine_delta")
    run_torchrun(2, [str(WORKERS / "separate_engine_worker.py"), "--case", "delta",
                     "--out", str(out), "--data", str(synthetic_data_dir),
                     "--steps", str(DELTA_STEPS), "--trainer-tp", "2", "--engine-tp", "1",
                     "--transport", "collective"])
    return json.loads((out / "result.json").read_text())


def _assert_rollouts_agree(rollout: dict) -> None:
    assert rollout["sequences"] > 0
    assert rollout["tokens_equal"] and rollout["lengths_equal"] and rollout["finished_equal"]
    assert rollout["max_logprob_diff"] <= LOGPROB_TP_TOLERANCE


def test_separate_engines_first_rollout_equals_the_colocated_samplers(engine_run):
    _assert_rollouts_agree(engine_run["first_rollout"])


def test_tp2_engine_serves_the_dp2_trainers_weights_bit_for_bit_after_3_low_rank_synced_steps(
        engine_run):
    steps = engine_run["steps"]
    assert len(steps) == NUM_STEPS
    assert all(step["sync_weights_match"] for step in steps)
    assert engine_run["mismatches_after_steps"] == []
    # Not the trivial equality: every target (and the Adam-trained non-targets) moved.
    assert set(engine_run["targets"]) <= set(engine_run["changed"])
    assert len(engine_run["changed"]) > len(engine_run["targets"])
    _assert_rollouts_agree(engine_run["after_steps_rollout"])


def test_low_rank_sync_ships_fewer_bytes_than_a_full_sync_and_reports_both(engine_run):
    for step in engine_run["steps"]:
        assert 0 < step["sync_bytes"] < step["sync_full_bytes"]


def test_the_step_record_splits_its_time_into_rollout_update_and_sync_phases(engine_run):
    for step in engine_run["steps"]:
        phases = [step["rollout_time_s"], step["update_time_s"], step["sync_time_s"]]
        assert all(t > 0 for t in phases)
        assert sum(phases) <= step["step_time_s"]  # disjoint parts of rank 0's step


def test_engine_refuses_a_repeated_and_a_gapped_update_and_changes_nothing(engine_run):
    refusals = engine_run["refusals"]
    assert "(repeated)" in refusals["repeated"] and "refusing update of" in refusals["repeated"]
    assert "(a gap)" in refusals["gap"]
    assert engine_run["mismatches_after_refusals"] == []


def test_a_checksum_mismatch_triggers_a_full_sync_that_restores_equality(engine_run):
    forced = engine_run["forced_mismatch"]
    assert forced["sync_weights_match"] is False
    assert forced["sync_bytes"] >= forced["sync_full_bytes"]  # the step's records + a full sync
    assert engine_run["mismatches_after_forced"] == []


def test_a_dead_engine_is_an_error_naming_the_rank_and_its_exit(engine_run):
    assert engine_run["dead_engine"].startswith("rollout engine rank 0 exited with code -9")


def test_collective_transport_keeps_a_tp2_engine_bit_for_bit_equal_to_the_tp2_trainer(
        collective_engine_run):
    run = collective_engine_run
    assert len(run["steps"]) == COLLECTIVE_STEPS
    # fp32 weights, every step checked: the digests of every served weight equal the trainer's.
    assert all(step["sync_weights_match"] for step in run["steps"])
    assert run["mismatches_after_steps"] == []
    assert set(run["targets"]) <= set(run["changed"])
    _assert_rollouts_agree(run["after_steps_rollout"])


def test_collective_transport_carries_every_record_byte_for_byte_headers_apart(
        collective_engine_run):
    wire, carried = collective_engine_run["wire"], collective_engine_run["wire"]["transport"]
    # Every record the trainer encoded went over the channel (each engine rank answered with the
    # digest of the record it rebuilt, which the client checked against the encoded bytes)...
    assert carried["records"] == wire["records"] > 0
    assert carried["header_bytes"] + carried["tensor_bytes"] == wire["bytes"]
    # ...and the control socket carried only the headers: the tensors went by broadcast.
    assert carried["tensor_bytes"] > 10 * carried["header_bytes"]


def test_collective_transport_leaves_refusals_and_mismatch_recovery_unchanged(
        collective_engine_run):
    refusals = collective_engine_run["refusals"]
    assert "(repeated)" in refusals["repeated"] and "(a gap)" in refusals["gap"]
    assert collective_engine_run["mismatches_after_refusals"] == []
    assert collective_engine_run["forced_mismatch"]["sync_weights_match"] is False
    assert collective_engine_run["mismatches_after_forced"] == []


@pytest.mark.parametrize("case", ["adam_fp32", "lora_bf16", "logra_bf16"])
def test_delta_sync_keeps_the_engine_bit_for_bit_equal_for_adam_lora_and_logra(
        delta_engine_runs, case):
    run = delta_engine_runs[case]
    assert len(run["steps"]) == DELTA_STEPS
    for step in run["steps"]:
        assert step["sync_mode"] == "delta"
        assert step["sync_weights_match"] is True  # every served weight's digest, every step
        assert 0 < step["sync_bytes"] < step["sync_full_bytes"]
        assert 0 < step["sync_changed_fraction"] < 1
    assert run["changed"] and run["mismatches_after_steps"] == []


def test_a_repeated_delta_is_refused_by_the_engine_naming_the_layer_and_changes_nothing(
        delta_engine_runs):
    for run in delta_engine_runs.values():
        message = run["refusals"]["repeated"]
        assert "refusing delta of " in message and "(repeated)" in message
        assert run["mismatches_after_refusals"] == []
