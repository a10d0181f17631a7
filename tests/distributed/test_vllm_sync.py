"""vLLM for real, kept in step with a real trainer by low-rank sync: its served weights equal the
trainer's, its log-probs of the trainer's tokens agree with the trainer's, and bad records and
stale weights are loud.

Two vLLM engines (each in its own venv and process, ``make setup-vllm``), at another layout
than their trainer's:

* the RL job itself, through the CLI (``megatron_logra rl ... rollout.placement=separate
  rollout.engine=vllm``): library mode, fp32, weight decay, a TP=2 trainer (column-parallel
  rows, fc1's [gate_t; up_t], row-parallel column slices; Adam's non-targets shipped dense) ->
  vLLM TP=1, started from the Hugging Face checkpoint the trainer writes, fully synced at start,
  low-rank synced after every update and checked after every step, generating each next batch
  while the trainer updates (``rollout.max_staleness=1``); then resumed from its step-1
  checkpoint (the next batch in flight, stored in it) with a new engine synced by delta
  (``sync.mode=delta``), continuing it exactly;
* a trainer job (tests/distributed/workers/vllm_sync_worker.py, 2 processes, 4 LoGRA updates)
  in paper mode, bf16 weights with fp32 masters, DP=2, which writes the checkpoint and the
  stream of wire records it would send -> vLLM TP=2 (its own sharding), fed that stream here
  over ``sync.transport=collective``: each record's header over the pipes, its tensor bytes
  broadcast from this process to both vLLM workers over a gloo group of their own (the RL job
  above uses the default rpc transport, so both transports are exercised); then, on the same
  engine, the delta streams of bf16 dense Adam, LoRA and LoGRA trainers (the worker's delta
  case) and corrupt, out-of-order and repeated deltas.

The weight check reads vLLM's parameters back from its workers (not the shadow) and compares
digests with the trainer's weights in the Hugging Face layout. Without ``.venv-vllm`` the
engines fail to start, saying to run ``make setup-vllm``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle

import pytest
import torch

from megatron_logra.rollout.vllm_engine import VLLMEngine
from megatron_logra.sync.records import LowRankUpdate
from megatron_logra.sync.wire import decode, encode
from megatron_logra.train.metrics import read_metrics
from tests.cli_runs import CliRuns
from tests.presets import SWIGLU_RMSNORM_NO_BIAS
from tests.torchrun import REPO, WORKERS, run_torchrun

pytestmark = pytest.mark.distributed

NUM_UPDATES = 4
# Per-token log-prob agreement of vLLM with the trainer's recomputation, measured on this model
# (docs/vllm.md): 4.8e-7 in fp32, 3.9e-3 in bf16. Both compute the same function of the same
# weights with other kernels (vLLM's fused qkv / gate_up, CPU attention, RMSNorm), so they differ
# by rounding only: fp32 rounding of sums over a few hundred terms (bound 1e-5, 20x the
# measurement), and in bf16 every layer's activations rounded to 8 bits (bound 0.05, 13x).
LOGPROB_TOL = {"float32": 1e-5, "bfloat16": 0.05}


def _trainer_stream(case: str, data_dir, tmp_path_factory) -> tuple[dict, list[bytes], str]:
    out = tmp_path_factory.mktemp(f"vllm_stream_{case}")
    run_torchrun(2, [str(WORKERS / "vllm_sync_worker.py"), "--case", case, "--out", str(out),
                     "--data", str(data_dir), "--updates", str(NUM_UPDATES)])
    stream = [payload for _, payload in pickle.loads((out / "stream.pkl").read_bytes())]
    return json.loads((out / "result.json").read_text()), stream, str(out / "hf")


def _synced_engine(case: str, engine_tp: int, data_dir, tmp_path_factory, transport: str):
    result, stream, hf_dir = _trainer_stream(case, data_dir, tmp_path_factory)
    engine = VLLMEngine(hf_dir, target_names=result["targets"], tensor_parallel=engine_tp,
                        dtype=result["served_dtype"], transport=transport,
                        log_path=tmp_path_factory.mktemp("vllm_log") / "engine.log")
    engine.start()
    for payload in stream:
        engine.apply_sync(payload)
    return engine, result, stream


RL_STEPS = 3
# The embedding's rows exceed the tokenizer's 91 ids (as Qwen2.5's 152064 rows do its 151665
# tokens), then Megatron pads them to 256: vLLM must serve the tokenizer's vocabulary, or it
# normalises (and samples) over the 69 rows beyond it too, random logits the trainer masks.
EMBEDDING_ROWS = 160
# The demo's RL config at the tiny size vLLM's CPU attention accepts (head width 32: 128 / 4
# heads), an embedding padded beyond the tokenizer (EMBEDDING_ROWS), 2 query groups of 2 heads (linear_qkv's per-group interleave differs from vLLM's
# [q; k; v], and TP=2 splits whole groups); library mode with weight decay, so every kind of
# record travels. Every step's weights are checked (sync.check_interval=1). Sampling at T = 0.7:
# pi_rollout is log softmax(z / T), which vLLM reports only in its processed_logprobs mode (its
# default gave a mean gap of -1.4e-2 here, 1000x the tolerance). vLLM generates each next batch
# while the trainer updates (rollout.max_staleness=1): batches 1 and 2 come from version 0, batch
# 3 from version 1.
RL_OVERRIDES = [
    "parallel.tp=2", "model.hidden_size=128", "model.ffn_hidden_size=256",
    f"model.vocab_size={EMBEDDING_ROWS}",
    "model.num_query_groups=2", *SWIGLU_RMSNORM_NO_BIAS, "model.params_dtype=fp32",
    "logra.mode=library", "optimizer.weight_decay=0.1", f"train.steps={RL_STEPS}",
    "train.micro_batch_size=4", "rl.prompts_per_step=8", "rl.sampling.max_new_tokens=5",
    "rl.sampling.temperature=0.7",
    "rl.eval.interval=0", "rl.eval.prompts=8", "rl.eval.samples=2",
    "logra.kl_control.probe_responses=4", "rollout.placement=separate", "rollout.engine=vllm",
    "rollout.tp=1", "sync.check_interval=1", "rollout.start_timeout_s=900",
    "rollout.max_staleness=1",
]


# The RL run saves a checkpoint after every step; the resumed run starts from step RESUME_AT's
# (a copy) with a fresh vLLM engine and runs the remaining steps, syncing it by delta (the XOR
# of the served fp32 weights: the engine keeps no shadow) where the run it continues synced
# low-rank records: the mode must not change what vLLM serves.
RESUME_AT = 1
CHECKPOINTED = ["checkpoint.interval=1"]
RESUMED_BY_DELTA = [*CHECKPOINTED, "sync.mode=delta"]


@pytest.fixture(scope="module")
def vllm_rl_runs(synthetic_data_dir, tmp_path_factory) -> CliRuns:
    return CliRuns(tmp_path_factory.mktemp("vllm_rl"), "rl", REPO / "configs" / "demo_rl_cpu.yaml",
                   RL_OVERRIDES, synthetic_data_dir)


def _sync_steps(run) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "sync_bytes" in r]


@pytest.fixture(scope="module")
def rl_run_with_tp1_vllm_engine(vllm_rl_runs) -> list[dict]:
    return _sync_steps(vllm_rl_runs.run("tp2_fp32_trainer", 2, CHECKPOINTED, checkpointed=True))


@pytest.fixture(scope="module")
def resumed_rl_run_with_tp1_vllm_engine(vllm_rl_runs, rl_run_with_tp1_vllm_engine) -> list[dict]:
    run = vllm_rl_runs.forked("tp2_fp32_trainer_resumed", "tp2_fp32_trainer", RESUME_AT,
                              (2, RESUMED_BY_DELTA))
    return _sync_steps(run)


# What a resumed step must repeat exactly: what the sampled tokens, the rewards and the counts
# decide, and the full sync's size.
RESUME_EXACT_KEYS = ("step", "logra_update_count", "tokens", "response_length", "reward",
                     "reward_failed", "accuracy", "baseline", "sync_full_bytes",
                     "sync_weights_match")
# The rest of a step's computed metrics (loss, grad norm, KL, step size, log-prob gap) go
# through vLLM's log-probs of the sampled tokens, which differ between two engine instances by
# fp32 rounding: CPU vLLM forms its batches by timing, and a batch's shape changes its GEMMs'
# sums. Measured between two runs of the same uninterrupted step: 7e-8 relative in the grad
# norm, 1e-7 in the predicted KL. Bounds 100x that, relative; absolute for the near-zero
# log-prob gaps, LOGPROB_TOL.
RESUME_REL_TOL = 1e-5


# Not compared: what is measured (times, rates, memory; the state bytes logged at the first step
# of each invocation) and the low-rank bytes, whose record headers carry the step's lr as a
# shortest-repr decimal, one character longer or shorter with its last digits.
NOT_COMPARED = ("mem_bytes", "state_bytes", "host_state_bytes", "sync_bytes")
# The resumed run's sync mode (delta, with its changed fraction): asserted on its own below.
SYNC_MODE_KEYS = ("sync_mode", "sync_changed_fraction")


def _computed(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if not k.endswith("_s") and k not in NOT_COMPARED + SYNC_MODE_KEYS}


def _assert_continues(got: dict, want: dict) -> None:
    got, want = _computed(got), _computed(want)
    assert got.keys() == want.keys()
    for key, value in want.items():
        if key in RESUME_EXACT_KEYS or isinstance(value, bool) or not isinstance(
                value, int | float):
            assert got[key] == value, key
        else:
            assert math.isclose(got[key], value, rel_tol=RESUME_REL_TOL,
                                abs_tol=LOGPROB_TOL["float32"]), (key, got[key], value)


@pytest.fixture(scope="module")
def tp2_engine_of_dp2_bf16_trainer(synthetic_data_dir, tmp_path_factory):
    engine, result, stream = _synced_engine("dp2", 2, synthetic_data_dir, tmp_path_factory,
                                            transport="collective")
    yield engine, result, stream
    engine.close()


def test_rl_run_with_a_tp1_vllm_engine_checks_its_weights_equal_to_the_tp2_trainers_every_step(
        rl_run_with_tp1_vllm_engine):
    steps = rl_run_with_tp1_vllm_engine
    assert [r["step"] for r in steps] == list(range(1, RL_STEPS + 1))
    # Digests of every weight vLLM serves (fp32, read back from its worker) equal the trainer's
    # after every step, the last one included: the final weights bit for bit.
    assert all(r["sync_weights_match"] is True for r in steps)
    # The full sync at start happens before step 0's evaluation; after every update only the
    # low-rank records and the dense non-targets travel, fewer bytes than the refit they replace.
    for r in steps:
        assert 0 < r["sync_bytes"] < r["sync_full_bytes"]


def test_rl_run_vllm_rollout_logprobs_at_temperature_agree_with_the_trainers_recomputation(
        rl_run_with_tp1_vllm_engine):
    # On policy (step 1's batch; the later ones are one version stale), |log pi_rollout (vLLM's
    # sampling log-probs at T = 0.7) - log pi_trainer (the TP=2 trainer's recomputation of the
    # same tokens at T, over the tokenizer's vocabulary)| at every generated token of the step:
    # its maximum, which opposite errors cannot cancel. With the padded embedding rows in
    # vLLM's softmax the gap was ~0.5 nats (and ids beyond the tokenizer were sampled).
    steps = rl_run_with_tp1_vllm_engine
    assert [r["batch_version"] for r in steps] == [0, 0, 1]
    assert [r["staleness"] for r in steps] == [0, 1, 1]
    assert all(r["tokens"] > 0 for r in steps)
    assert steps[0]["logprob_gap_max"] <= LOGPROB_TOL["float32"]
    assert abs(steps[0]["logprob_gap_all_tokens"]) <= steps[0]["logprob_gap_max"]


def test_resumed_rl_run_resyncs_a_fresh_vllm_engine_and_continues_the_uninterrupted_run(
        rl_run_with_tp1_vllm_engine, resumed_rl_run_with_tp1_vllm_engine):
    """Steps RESUME_AT+1.. in a new job from the step-RESUME_AT checkpoint, with a new vLLM
    engine started from the Hugging Face checkpoint of the resumed policy.

    The engine's shadow accepts a low-rank record only after a full sync and only as the next
    count of its layer, so the resumed steps' accepted records and matching weights (checked
    after every step, read back from vLLM's worker) show the full sync at the resume, carrying
    the resumed update count. The layout is the uninterrupted run's (trainer TP=2, vLLM TP=1),
    the trainer's resume is exact and vLLM, given the same weights bit for bit and the same
    per-prompt seeds, samples the same tokens: so what the tokens and rewards decide repeats
    exactly (RESUME_EXACT_KEYS). The rest goes through vLLM's log-probs, which are reproducible
    between engine instances only to fp32 rounding (RESUME_REL_TOL); times and memory are
    not compared."""
    full, resumed = rl_run_with_tp1_vllm_engine, resumed_rl_run_with_tp1_vllm_engine
    assert [r["step"] for r in resumed] == list(range(1, RL_STEPS + 1))
    # Batch 2 was in flight at the step-1 checkpoint: the resumed job trains on the stored batch
    # (version 0, from the first engine), not on one generated again by the new engine.
    assert resumed[RESUME_AT]["batch_version"] == 0
    for want, got in zip(full[RESUME_AT:], resumed[RESUME_AT:], strict=True):
        assert got["sync_weights_match"] is True
        assert 0 < got["sync_bytes"] < got["sync_full_bytes"]
        _assert_continues(got, want)


def test_delta_sync_keeps_a_fresh_fp32_vllm_engine_bit_for_bit_and_serves_what_low_rank_did(
        rl_run_with_tp1_vllm_engine, resumed_rl_run_with_tp1_vllm_engine):
    """The resumed steps synced by delta (library-mode LoGRA with Adam-trained non-targets, fp32,
    TP=2 trainer -> vLLM TP=1, no shadow on the engine, the rpc transport): weights checked
    after every step, read back from vLLM. Their tokens and rewards repeat the low-rank run's
    exactly (the test above): vLLM sampled from the same weights either way."""
    full, resumed = rl_run_with_tp1_vllm_engine, resumed_rl_run_with_tp1_vllm_engine
    assert {r["sync_mode"] for r in full} == {"low_rank"}
    for r in resumed[RESUME_AT:]:
        assert r["sync_mode"] == "delta"
        assert r["sync_weights_match"] is True
        # fp32 with weight decay: every entry's bits change in a step (measured: all of them),
        # so the delta is the zstd of a dense XOR, still below a full sync's bytes.
        assert 0 < r["sync_changed_fraction"] <= 1
        assert 0 < r["sync_bytes"] < r["sync_full_bytes"]


def test_vllm_serves_the_trainers_weights_bit_for_bit_after_4_low_rank_updates(tp2_engine_of_dp2_bf16_trainer):
    engine, result, stream = tp2_engine_of_dp2_bf16_trainer
    assert result["update_count"] == NUM_UPDATES
    served = engine.weight_checksums()
    assert served == result["checksums"]  # every weight, HF layout, the served dtype's bits
    assert served != result["previous_checksums"]  # the last update reached the served weights
    low_rank = sum(isinstance(decode(p), LowRankUpdate) for p in stream)
    assert low_rank == NUM_UPDATES * len(result["targets"])


def test_collective_transport_carried_every_record_to_both_vllm_workers_byte_for_byte(
        tp2_engine_of_dp2_bf16_trainer):
    engine, _, stream = tp2_engine_of_dp2_bf16_trainer
    carried = engine.transport_stats
    # Each worker answered with the digest of the record it rebuilt from the broadcast, which
    # the client checked against the encoded bytes; the pipes carried only the headers.
    assert carried.records == len(stream)
    assert carried.header_bytes + carried.tensor_bytes == sum(len(p) for p in stream)
    assert carried.tensor_bytes > 10 * carried.header_bytes


def test_vllm_logprobs_of_the_trainers_tokens_match_its_recomputation(tp2_engine_of_dp2_bf16_trainer):
    engine, result, _ = tp2_engine_of_dp2_bf16_trainer
    vllm_BL = torch.tensor(engine.score(result["tokens"]))
    trainer_BL = torch.tensor(result["logprobs"])
    assert vllm_BL.shape == trainer_BL.shape
    assert (vllm_BL - trainer_BL).abs().max().item() <= LOGPROB_TOL[result["served_dtype"]]


def test_vllm_generates_tokens_with_their_logprobs(tp2_engine_of_dp2_bf16_trainer):
    engine, result, _ = tp2_engine_of_dp2_bf16_trainer
    prompts = [seq[:8] for seq in result["tokens"][:2]]
    samples = engine.generate(prompts, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=3,
                              stop_token_ids=[])
    assert [len(tokens) for tokens, _ in samples] == [6, 6]
    assert all(len(lps) == 6 and all(lp <= 0.0 for lp in lps) for _, lps in samples)
    # A fixed seed samples the same tokens again (a per-request generator); their log-probs
    # agree to the served dtype's rounding (the second batch's kernels may sum in another order:
    # 1 ulp seen in fp32).
    again = engine.generate(prompts, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=3,
                            stop_token_ids=[])
    assert [tokens for tokens, _ in again] == [tokens for tokens, _ in samples]
    assert torch.allclose(torch.tensor([lps for _, lps in again]),
                          torch.tensor([lps for _, lps in samples]),
                          rtol=0.0, atol=LOGPROB_TOL[result["served_dtype"]])


def test_vllm_refuses_repeated_and_gapped_low_rank_updates_and_changes_nothing(tp2_engine_of_dp2_bf16_trainer):
    engine, result, stream = tp2_engine_of_dp2_bf16_trainer
    last = next(p for p in reversed(stream) if isinstance(decode(p), LowRankUpdate))
    record = decode(last)
    expected = f"refusing update of {record.layer_key}: expected update_count {NUM_UPDATES + 1}"
    with pytest.raises(RuntimeError, match=f"{expected}, got {NUM_UPDATES} \\(repeated\\)"):
        engine.apply_sync(last)
    gap = encode(dataclasses.replace(record, update_count=NUM_UPDATES + 2), wire_dtype="fp32")
    with pytest.raises(RuntimeError, match=f"{expected}, got {NUM_UPDATES + 2} \\(a gap\\)"):
        engine.apply_sync(gap)
    engine.check_weights(result["checksums"])


def test_vllm_checksum_check_names_the_weights_that_differ(tp2_engine_of_dp2_bf16_trainer):
    engine, result, _ = tp2_engine_of_dp2_bf16_trainer
    stale = sorted(n for n, d in result["previous_checksums"].items()
                   if result["checksums"][n] != d)
    assert stale
    with pytest.raises(RuntimeError, match="checksum mismatch: the vLLM engine serves") as error:
        engine.check_weights(result["previous_checksums"])
    assert f"{len(stale)} weight(s)" in str(error.value) and stale[0] in str(error.value)


def test_engine_start_without_the_vllm_venv_fails_naming_make_setup_vllm(tmp_path):
    engine = VLLMEngine(tmp_path, target_names=[], venv=tmp_path / "no-venv")
    with pytest.raises(RuntimeError, match="run `make setup-vllm`"):
        engine.start()


# ---------------------------------------------------------------------- sync.mode=delta, bf16
# The dp2 test's TP=2 bf16 vLLM engine, after its low-rank tests, serves three more trainers of
# the same model (tests/distributed/workers/vllm_sync_worker.py's delta case, trainer TP=2):
# dense Adam, LoRA (served merged) and LoGRA paper mode, each opened by a full sync of its served
# weights -- which resets the engine's counts and weights, and, its targets arriving in bf16,
# leaves no fp32 master of them (the engine was started with a shadow for low-rank records) --
# then one delta per update. Then the low-rank stream again, so the engine ends as the low-rank
# tests left it. (fp32 served weights: the resumed RL run above syncs by delta.)
DELTA_UPDATES = 3


@pytest.fixture(scope="module")
def bf16_delta_streams(synthetic_data_dir, tmp_path_factory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("vllm_delta_streams")
    run_torchrun(2, [str(WORKERS / "vllm_sync_worker.py"), "--case", "delta", "--out", str(out),
                     "--data", str(synthetic_data_dir), "--updates", str(DELTA_UPDATES)])
    return (json.loads((out / "result.json").read_text()),
            pickle.loads((out / "delta_streams.pkl").read_bytes()))


def _refusal(engine: VLLMEngine, payload: bytes) -> str:
    try:
        engine.apply_sync(payload)
    except RuntimeError as error:
        return str(error)
    return "accepted"


def _bad_deltas(updates: list[list[bytes]]) -> dict[str, tuple[bytes, str]]:
    """Against an engine holding update 1: update 2's bucket with the last tensor's frame
    corrupted in transit (its other tensors intact), update 3's bucket (out of order), update
    1's bucket again (repeated); each with the tensor its refusal must name."""
    bucket = max((decode(p) for p in updates[2]), key=lambda b: len(b.tensors))
    assert len(bucket.tensors) > 1
    name, delta = list(bucket.tensors.items())[-1]
    frame = bytearray(delta.frame)
    frame[len(frame) // 2] ^= 0xFF
    corrupt = dataclasses.replace(bucket, tensors={
        **bucket.tensors, name: dataclasses.replace(delta, frame=bytes(frame))})
    ahead = decode(updates[3][0])
    ahead_name = next(n for n, t in ahead.tensors.items() if t.base_count == 2)
    again = decode(updates[1][0])
    return {"corrupt": (encode(corrupt, wire_dtype="fp32"), name),
            "out of order": (updates[3][0], ahead_name),
            "repeated": (updates[1][0], next(iter(again.tensors)))}


@pytest.fixture(scope="module")
def bf16_delta_synced_vllm(tp2_engine_of_dp2_bf16_trainer, bf16_delta_streams):
    engine, _, low_rank_stream = tp2_engine_of_dp2_bf16_trainer
    result, streams = bf16_delta_streams
    served: dict[str, list[dict]] = {}
    refusals: dict[str, tuple[str, str]] = {}
    after_refusals = None
    for optimizer, updates in streams.items():
        served[optimizer] = []
        for update, payloads in enumerate(updates):
            for payload in payloads:
                engine.apply_sync(payload)
            served[optimizer].append(engine.weight_checksums())
            if update == 1 and not refusals:
                bad = _bad_deltas(updates)
                refusals = {kind: (_refusal(engine, payload), name)
                            for kind, (payload, name) in bad.items()}
                after_refusals = (optimizer, engine.weight_checksums())
    for payload in low_rank_stream:  # the engine as the low-rank tests leave it
        engine.apply_sync(payload)
    return result, served, refusals, after_refusals


@pytest.mark.parametrize("optimizer", ["adam", "lora", "logra"])
def test_vllm_serves_the_trainers_bf16_weights_bit_for_bit_after_every_delta_synced_update(
        bf16_delta_synced_vllm, optimizer):
    result, served, _, _ = bf16_delta_synced_vllm
    trainer = result[optimizer]
    # Every weight, read back from both vLLM workers in the Hugging Face layout, after the full
    # sync and after each of the 3 deltas (with the refused deltas between 1 and 2 for Adam).
    assert len(served[optimizer]) == DELTA_UPDATES + 1
    assert served[optimizer] == trainer["checksums"]
    # Not the trivial equality: every update changed the served weights (measured 16-23% of
    # the entries for Adam and LoGRA, 85% for LoRA, whose merged B A moves every entry).
    for before, after in zip(trainer["checksums"], trainer["checksums"][1:], strict=False):
        assert before != after
    assert all(0 < f < 1 for f in trainer["changed_fraction"])
    assert all(0 < b < trainer["bytes"][0] for b in trainer["bytes"][1:])  # below a full sync


def test_vllm_refuses_a_corrupt_an_out_of_order_and_a_repeated_delta_naming_the_tensor(
        bf16_delta_synced_vllm):
    result, _, refusals, (optimizer, after) = bf16_delta_synced_vllm
    message, name = refusals["corrupt"]
    assert f"refusing delta of {name} (update base 1)" in message
    assert "corrupt" in message or "do not match their checksum" in message
    message, name = refusals["out of order"]
    assert (f"refusing delta of {name} to update 3: it is against update 2, the engine holds "
            "update 1 (out of order)") in message
    message, name = refusals["repeated"]
    assert f"refusing delta of {name} to update 1" in message and "(repeated)" in message
    # Nothing changed: not the corrupt bucket's intact tensors either (every tensor is checked
    # before any is applied).
    assert after == result[optimizer]["checksums"][1]
