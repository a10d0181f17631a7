"""The Megatron rollout engine on real Megatron-Core GPTs over gloo.

Two torchrun jobs run ``workers/sampler_worker.py``: one process (TP=1, the reference, with the
cache-free, full-vocabulary and nucleus references, EOS, chunking and error checks) and two
processes (TP=2, TP=2 with sequence parallelism, DP=2 and PP=2 in turn). Each test asserts one
claim on the JSON they write; the worker's docstring describes the model, prompts and configs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.layouts import SAMPLER_LAYOUTS as LAYOUTS
from tests.torchrun import WORKERS, run_torchrun

pytestmark = pytest.mark.distributed

WORKER = str(WORKERS / "sampler_worker.py")
CONFIGS = ("greedy", "sampled", "nucleus")
SAMPLED_CONFIGS = ("sampled", "nucleus")
TOP_P = {"greedy": 1.0, "sampled": 1.0, "nucleus": 0.5}

# Sampler vs trainer log-probs of the same tokens, fp32: logits of size ~5-10 (ulp ~1e-6) reached
# by different summation orders (one cached decode position vs a full forward; rotary angles by
# cache slot vs by position; a different log-softmax reduction), divided by T = 0.7 at worst;
# measured <= 2.2e-6 over every layout and config.
RECOMPUTE_ABS_TOL = 2e-5
# The same log-probs generated under another layout (TP-split sums, sequence-parallel prefill,
# a half batch with different padding) vs TP=1: the same rounding sources; measured <= 2.4e-6.
LAYOUT_LOGPROB_ABS_TOL = 2e-5
# Megatron's vocab-parallel cross entropy vs torch.log_softmax on the same fp32 logits: two
# max-shifted log-sum-exp reductions in different orders; measured 4.8e-7.
TRAINER_VS_LOG_SOFTMAX_ABS_TOL = 5e-6
# -log(nucleus mass) from the plain forward's logits (float64 per-token walk) vs the sampler's
# sampling_logprobs - logprobs (from its cached fp32 logits); the logits differ by ~1e-6 and the
# mass is O(1); measured 5.1e-7.
NUCLEUS_LOG_MASS_ABS_TOL = 1e-5
# TP=2 shards vs full-vocabulary autograd on logits of size ~4/0.7: values measured 9.5e-7
# (log-sum-exp of ~6 in fp32), gradients (softmax entries in [0, 1]) measured 2.4e-7.
VOCAB_PARALLEL_VALUE_ABS_TOL = 1e-5
VOCAB_PARALLEL_GRAD_ABS_TOL = 2e-6
# A chunk of 4 and one of 2 prompts are padded differently from one batch of 6, which changes
# rotary angles and reduction lengths by rounding only; measured 1.9e-6.
CHUNKED_LOGPROB_ABS_TOL = 2e-5


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return Path(tmp_path_factory.mktemp("sampler"))


@pytest.fixture(scope="module")
def tp1(out_dir) -> dict:
    run_torchrun(1, [WORKER, "--case", "tp1", "--out", str(out_dir)])
    return json.loads((out_dir / "tp1.json").read_text())


@pytest.fixture(scope="module")
def layouts(out_dir) -> dict:
    run_torchrun(2, [WORKER, "--case", "layouts", "--out", str(out_dir)])
    return json.loads((out_dir / "layouts.json").read_text())["layouts"]


def max_gap(first: list[list[float]], second: list[list[float]]) -> float:
    return max(
        abs(a - b) for row_a, row_b in zip(first, second, strict=True)
        for a, b in zip(row_a, row_b, strict=True)
    )


def test_sampler_logprobs_equal_trainer_recomputed_logprobs_in_every_layout(tp1, layouts):
    for config in CONFIGS:
        assert tp1["configs"][config]["recompute_gap"] < RECOMPUTE_ABS_TOL, config
        for layout in LAYOUTS:
            gap = layouts[layout]["configs"][config]["recompute_gap"]
            assert gap < RECOMPUTE_ABS_TOL, (layout, config, gap)


def test_trainer_recomputation_equals_log_softmax_of_full_vocabulary_logits(tp1):
    for config in CONFIGS:
        gap = tp1["configs"][config]["trainer_vs_full_log_softmax"]
        assert gap < TRAINER_VS_LOG_SOFTMAX_ABS_TOL, (config, gap)


def test_vocab_parallel_logprobs_and_gradients_equal_full_vocabulary_autograd(layouts):
    check = layouts["tp2"]["vocab_parallel_gradients"]
    assert check["value_error"] < VOCAB_PARALLEL_VALUE_ABS_TOL, check
    assert check["grad_error"] < VOCAB_PARALLEL_GRAD_ABS_TOL, check
    assert check["padding_grad_max"] == 0.0, check


def test_every_tensor_and_pipeline_rank_of_a_replica_returns_the_same_batch(layouts):
    for layout in LAYOUTS:
        for config in CONFIGS:
            assert layouts[layout]["configs"][config]["replicas_identical"], (layout, config)


def test_tp2_sequence_parallel_dp2_and_pp2_generate_the_tokens_of_tp1(tp1, layouts):
    assert layouts["tp2_sp"]["sequence_parallel"] and not layouts["tp2"]["sequence_parallel"]
    assert (layouts["pp2"]["pp"], layouts["dp2"]["dp"], layouts["tp2"]["tp"]) == (2, 2, 2)
    for layout in LAYOUTS:
        for config in CONFIGS:
            entry, reference = layouts[layout]["configs"][config], tp1["configs"][config]
            assert entry["indices"] == reference["indices"] == list(range(6)), (layout, config)
            assert entry["responses"] == reference["responses"], (layout, config)
            assert entry["finished"] == reference["finished"], (layout, config)
            gap = max_gap(entry["logprobs"], reference["logprobs"])
            assert gap < LAYOUT_LOGPROB_ABS_TOL, (layout, config, gap)


def test_data_parallel_ranks_generate_disjoint_halves_of_the_global_batch(layouts):
    for config in CONFIGS:
        entry = layouts["dp2"]["configs"][config]
        assert entry["share_sizes"] == [3], entry["share_sizes"]
        assert entry["indices"] == list(range(6))


def test_pp2_logprobs_are_bit_identical_to_pp1(tp1, layouts):
    for config in CONFIGS:
        entry, reference = layouts["pp2"]["configs"][config], tp1["configs"][config]
        assert entry["logprobs"] == reference["logprobs"], config


def test_kv_cached_greedy_decoding_equals_cache_free_decoding(tp1):
    for model in ("rope_gqa", "learned_absolute"):
        entry = tp1["cache_free"][model]
        assert entry["cached"] == entry["cache_free"], model
        assert all(len(response) == 8 for response in entry["cached"]), model


def test_sampled_tokens_lie_in_the_top_p_nucleus_and_sampling_logprobs_are_renormalised(tp1):
    for config in SAMPLED_CONFIGS:
        entry = tp1["configs"][config]
        assert entry["num_tokens"] == 48
        assert entry["tokens_outside_nucleus"] == 0, config
        assert entry["nucleus_log_mass_error"] < NUCLEUS_LOG_MASS_ABS_TOL, (config, entry)
    assert tp1["configs"]["sampled"]["sampling_equals_logprobs"]
    assert not tp1["configs"]["nucleus"]["sampling_equals_logprobs"]
    assert tp1["configs"]["greedy"]["sampling_logprobs_all_zero"]


def test_a_stop_set_ends_each_response_at_its_first_stop_token_and_keeps_it(tp1):
    eos = tp1["eos"]
    reference = eos["reference"]
    for run, stops in (("with_eos", {eos["eos_batch"]}), ("single", {eos["eos_single"]}),
                       ("with_stop_set", {eos["eos_batch"], eos["second_stop"]})):
        result = eos[run]
        for i, full in enumerate(reference["responses"][: len(result["responses"])]):
            hits = [at for at, token in enumerate(full) if token in stops]
            end = hits[0] + 1 if hits else len(full)
            assert result["responses"][i] == full[:end], (run, i)
            assert result["lengths"][i] == end, (run, i)
            assert result["finished"][i] == bool(hits), (run, i)
    # A stop set ends some responses earlier than its first token alone does.
    assert sum(eos["with_stop_set"]["lengths"]) < sum(eos["with_eos"]["lengths"])
    # Same batch, same padding: the kept prefix is computed exactly as without EOS.
    for i, logprobs in enumerate(eos["with_eos"]["logprobs"]):
        assert logprobs == reference["logprobs"][i][: len(logprobs)], i
    # The batch run mixes responses that end (at different steps) with ones cut at the limit.
    assert 1 < sum(eos["with_eos"]["finished"]) < len(eos["with_eos"]["finished"])
    assert len(set(eos["with_eos"]["lengths"])) > 2


def test_generation_stops_once_every_response_has_ended(tp1):
    eos = tp1["eos"]
    # One forward (the prefill) produces the first token; each further token costs one.
    assert eos["single"]["lengths"] == [3] and eos["single"]["finished"] == [True]
    assert eos["forwards"]["single"] == 3 < eos["max_new_tokens"]
    assert eos["forwards"]["with_eos"] == max(eos["with_eos"]["lengths"])


def test_without_eos_every_response_runs_to_max_new_tokens(tp1):
    eos = tp1["eos"]
    limit = eos["max_new_tokens"]
    assert eos["without_eos"] == eos["reference"]
    assert eos["without_eos"]["lengths"] == [limit] * 6
    assert eos["without_eos"]["finished"] == [False] * 6
    assert eos["forwards"]["without_eos"] == limit
    for config in CONFIGS:
        assert tp1["configs"][config]["lengths"] == [limit] * 6, config


def test_generation_in_chunks_equals_one_batch(tp1):
    assert tp1["chunked"]["responses_equal"]
    assert tp1["chunked"]["logprob_gap"] < CHUNKED_LOGPROB_ABS_TOL, tp1["chunked"]


def test_generation_leaves_weights_and_training_mode_unchanged(tp1):
    assert tp1["weights_unchanged"]
    assert tp1["training_flags_restored"]


def test_sampler_rejects_bad_requests_naming_the_problem(tp1, layouts):
    expected = {
        "token_out_of_vocab": "ValueError: prompts[0][1]=100 is not a token id in [0, 100)",
        "empty_prompt": "ValueError: prompts[1]=[] must be a non-empty list",
        "negative_seed": "ValueError: seed=-1 must be an integer >= 0",
        "eos_out_of_vocab": "ValueError: stop_ids [100] are outside the vocabulary [0, 100)",
        "two_chunks": "ValueError: generation needs exactly one model chunk per rank, got 2",
        "vocab_too_large": "ValueError: vocab_size=129 must be in [1, 128]",
        "positions_exhausted": "ValueError: the longest prompt (30 tokens) + max_new_tokens (3) "
        "exceeds the model's learned positions (model.seq_length=32)",
    }
    assert set(tp1["errors"]) == set(expected)
    for name, prefix in expected.items():
        assert tp1["errors"][name].startswith(prefix), (name, tp1["errors"][name])
    assert layouts["dp2"]["mismatched_request"].startswith(
        "RuntimeError: MegatronSampler.generate was called with different prompts"
    )
