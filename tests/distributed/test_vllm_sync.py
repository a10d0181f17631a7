"""vLLM for real, kept in step with a real trainer by low-rank sync: its served weights equal the
trainer's, its log-probs of the trainer's tokens agree with the trainer's, and bad records and
stale weights are loud.

Two trainer jobs (tests/distributed/workers/vllm_sync_worker.py, 2 processes each, 4 LoGRA
updates of the tiny grouped-query GPT) write a Hugging Face checkpoint of the initial weights and
the stream of wire records a trainer sends; each feeds one vLLM engine (its own venv and process,
``make setup-vllm``), at another layout than the trainer's:

* library mode, fp32, TP=2 trainer (column-parallel rows, fc1's [gate_t; up_t], row-parallel
  column slices; Adam's non-targets shipped dense) -> vLLM TP=1;
* paper mode, bf16 weights with fp32 masters, DP=2 trainer -> vLLM TP=2 (its own sharding).

The weight check reads vLLM's parameters back from its workers (not the shadow) and compares
digests with the trainer's weights in the Hugging Face layout. Without ``.venv-vllm`` the engine
fixtures fail, saying to run ``make setup-vllm``.
"""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
import torch

from megatron_logra.rollout.vllm_engine import VLLMEngine
from megatron_logra.sync.records import LowRankUpdate
from megatron_logra.sync.wire import decode, encode
from tests.torchrun import WORKERS, run_torchrun

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


def _synced_engine(case: str, engine_tp: int, data_dir, tmp_path_factory):
    result, stream, hf_dir = _trainer_stream(case, data_dir, tmp_path_factory)
    engine = VLLMEngine(hf_dir, target_names=result["targets"], tensor_parallel=engine_tp,
                        dtype=result["served_dtype"],
                        log_path=tmp_path_factory.mktemp("vllm_log") / "engine.log")
    engine.start()
    for payload in stream:
        engine.apply_sync(payload)
    return engine, result, stream


@pytest.fixture(scope="module")
def tp1_engine_of_tp2_fp32_trainer(synthetic_data_dir, tmp_path_factory):
    engine, result, stream = _synced_engine("tp2", 1, synthetic_data_dir, tmp_path_factory)
    yield engine, result, stream
    engine.close()


@pytest.fixture(scope="module")
def tp2_engine_of_dp2_bf16_trainer(synthetic_data_dir, tmp_path_factory):
    engine, result, stream = _synced_engine("dp2", 2, synthetic_data_dir, tmp_path_factory)
    yield engine, result, stream
    engine.close()


@pytest.fixture(params=["tp1_engine_of_tp2_fp32_trainer", "tp2_engine_of_dp2_bf16_trainer"])
def synced(request):
    return request.getfixturevalue(request.param)


def test_vllm_serves_the_trainers_weights_bit_for_bit_after_4_low_rank_updates(synced):
    engine, result, stream = synced
    assert result["update_count"] == NUM_UPDATES
    served = engine.weight_checksums()
    assert served == result["checksums"]  # every weight, HF layout, the served dtype's bits
    assert served != result["previous_checksums"]  # the last update reached the served weights
    low_rank = sum(isinstance(decode(p), LowRankUpdate) for p in stream)
    assert low_rank == NUM_UPDATES * len(result["targets"])


def test_vllm_logprobs_of_the_trainers_tokens_match_its_recomputation(synced):
    engine, result, _ = synced
    vllm_BL = torch.tensor(engine.score(result["tokens"]))
    trainer_BL = torch.tensor(result["logprobs"])
    assert vllm_BL.shape == trainer_BL.shape
    assert (vllm_BL - trainer_BL).abs().max().item() <= LOGPROB_TOL[result["served_dtype"]]


def test_vllm_generates_tokens_with_their_logprobs(tp1_engine_of_tp2_fp32_trainer):
    engine, result, _ = tp1_engine_of_tp2_fp32_trainer
    prompts = [seq[:8] for seq in result["tokens"][:2]]
    samples = engine.generate(prompts, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=3)
    assert [len(tokens) for tokens, _ in samples] == [6, 6]
    assert all(len(lps) == 6 and all(lp <= 0.0 for lp in lps) for _, lps in samples)
    # A fixed seed samples the same tokens again (a per-request generator); their log-probs
    # agree to fp32 rounding (the second batch's kernels may sum in another order: 1 ulp seen).
    again = engine.generate(prompts, max_new_tokens=6, temperature=1.0, top_p=1.0, seed=3)
    assert [tokens for tokens, _ in again] == [tokens for tokens, _ in samples]
    assert torch.allclose(torch.tensor([lps for _, lps in again]),
                          torch.tensor([lps for _, lps in samples]),
                          rtol=0.0, atol=LOGPROB_TOL["float32"])


def test_vllm_refuses_repeated_and_gapped_low_rank_updates_and_changes_nothing(synced):
    engine, result, stream = synced
    last = next(p for p in reversed(stream) if isinstance(decode(p), LowRankUpdate))
    record = decode(last)
    expected = f"refusing update of {record.layer_key}: expected update_count {NUM_UPDATES + 1}"
    with pytest.raises(RuntimeError, match=f"{expected}, got {NUM_UPDATES} \\(repeated\\)"):
        engine.apply_sync(last)
    gap = encode(dataclasses.replace(record, update_count=NUM_UPDATES + 2), wire_dtype="fp32")
    with pytest.raises(RuntimeError, match=f"{expected}, got {NUM_UPDATES + 2} \\(a gap\\)"):
        engine.apply_sync(gap)
    engine.check_weights(result["checksums"])


def test_vllm_checksum_check_names_the_weights_that_differ(synced):
    engine, result, _ = synced
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
