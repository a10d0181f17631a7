"""The separate rollout engine's configuration and the trainer-side pieces that need no engine:
the ``rollout`` / ``sync`` checks name field, value and fix; the RolloutBatch built from an
engine's responses; the engine's own config; ``make_engine`` naming a missing vLLM client."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from megatron_logra.config import RolloutConfig, SyncConfig, config_from_dict, load_config
from megatron_logra.mcore.models.sync_state import target_param_names
from megatron_logra.rl.rollout import SamplingParams
from megatron_logra.rollout.engine import GenerationEngine
from megatron_logra.rollout.factory import VLLM_CLIENT_MODULE, make_engine
from megatron_logra.rollout.megatron_engine import MegatronEngine, engine_config
from megatron_logra.rollout.vllm_engine import VLLMEngine
from megatron_logra.train.rl.engine_rollouts import check_response_ids, rollout_batch

SEPARATE = ["rollout.placement=separate", "optimizer.name=logra"]
# A model vLLM can serve (a Llama-style checkpoint through our converter).
LLAMA_STYLE = ["model.normalization=RMSNorm", "model.activation=swiglu",
               "model.position_embedding=rope"]


def _refused(overrides: list[str], fragments: list[str], command: str = "rl") -> None:
    with pytest.raises(ValueError) as info:
        load_config(None, overrides, command=command).resolved(1, command)
    for fragment in fragments:
        assert re.search(re.escape(fragment), str(info.value)), (fragment, str(info.value))


def test_colocated_is_the_default_and_auto_sync_is_low_rank_for_logra_full_otherwise():
    cfg = load_config(None, [])
    assert cfg.rollout.placement == "colocated" and not cfg.rollout.separate
    assert cfg.sync.resolved_mode("logra") == "low_rank"
    assert cfg.sync.resolved_mode("adam") == "full"
    assert cfg.sync.resolved_mode("lora") == "full"


@pytest.mark.parametrize(("overrides", "fragments"), [
    (["rollout.placement=nearby"], ["rollout.placement='nearby'", "colocated", "separate"]),
    (["rollout.engine=sglang"], ["rollout.engine='sglang'", "megatron", "vllm"]),
    (["rollout.tp=0"], ["rollout.tp=0", ">= 1"]),
    (["sync.mode=sparse"], ["sync.mode='sparse'", "delta"]),
    (["sync.wire_dtype=fp16"], ["sync.wire_dtype='fp16'", "bf16"]),
    (["sync.full_interval=-1"], ["sync.full_interval=-1", ">= 0"]),
    (["sync.check_interval=-2"], ["sync.check_interval=-2", ">= 0"]),
    (["sync.bucket_bytes=0"], ["sync.bucket_bytes=0", "> 0"]),
])
def test_bad_rollout_and_sync_values_are_refused_naming_field_value_and_choices(
        overrides, fragments):
    _refused(overrides, fragments)


# A value other than the default, for every field that acts only on a separate engine: the
# separate engine's rollout fields and every sync field.
SEPARATE_ONLY_VALUES = {
    "rollout.engine": "vllm", "rollout.tp": "2", "rollout.start_timeout_s": "1200",
    "rollout.request_timeout_s": "3600", "rollout.vllm_venv": "/opt/vllm-venv",
    "rollout.devices": "[4]", "rollout.cpus": "[0]", "sync.mode": "full", "sync.wire_dtype": "bf16",
    "sync.full_interval": "5", "sync.check_interval": "0", "sync.bucket_bytes": "1024",
    "sync.transport": "collective",
}


def test_every_separate_engine_setting_is_listed_for_the_colocated_refusal():
    from dataclasses import fields

    from megatron_logra.config import SyncConfig
    from megatron_logra.config.rollout import SEPARATE_ENGINE_FIELDS

    assert set(SEPARATE_ONLY_VALUES) == {f"rollout.{n}" for n in SEPARATE_ENGINE_FIELDS} | {
        f"sync.{f.name}" for f in fields(SyncConfig)}


@pytest.mark.parametrize("key", sorted(SEPARATE_ONLY_VALUES))
def test_a_separate_engine_setting_with_colocated_rollouts_is_refused(key):
    """Accepted and ignored before: the trainer samples with its own weights."""
    # (a vLLM venv alone is refused for the default engine, which runs in no venv of its own)
    engine = ["rollout.engine=vllm"] if key == "rollout.vllm_venv" else []
    _refused([*engine, f"{key}={SEPARATE_ONLY_VALUES[key]}"],
             [f"{key}=", "rollout.placement=colocated", "rollout.placement=separate"])


def test_a_collective_timeout_the_megatron_engines_idle_ranks_cannot_meet_is_refused():
    """Its ranks other than 0 wait in collectives of this timeout while the trainer updates,
    woken every ENGINE_IDLE_BROADCAST_S: a shorter timeout cannot hold. (The trainer's own
    waits on the engine are not bounded by it: tests/distributed/test_separate_engine.py.)"""
    _refused([*SEPARATE, "rollout.tp=2", "parallel.collective_timeout_s=20"],
             ["parallel.collective_timeout_s=20", "rollout.tp=2", "every 30 s",
              "above 30"])
    for accepted in (["rollout.tp=1", "parallel.collective_timeout_s=20"],
                     ["rollout.tp=2", "parallel.collective_timeout_s=31"]):
        load_config(None, [*SEPARATE, *accepted]).resolved(1, "rl")


def test_a_vllm_venv_for_the_megatron_engine_is_refused():
    _refused([*SEPARATE, "rollout.vllm_venv=/opt/vllm-venv"],
             ["rollout.vllm_venv='/opt/vllm-venv'", "rollout.engine=megatron",
              "rollout.engine=vllm"])


def test_low_rank_sync_is_refused_for_dense_and_lora_optimizers():
    for name in ("adam", "lora"):
        _refused(["rollout.placement=separate", f"optimizer.name={name}", "sync.mode=low_rank"],
                 ["sync.mode=low_rank", f"optimizer.name={name}", "sync.mode=full"])
    load_config(None, ["rollout.placement=separate", "optimizer.name=adam"]).resolved(1, "rl")


def test_bf16_wire_is_refused_where_it_would_round_and_accepted_for_paper_bf16_factors():
    _refused([*SEPARATE, "logra.mode=library", "sync.wire_dtype=bf16"],
             ["sync.wire_dtype=bf16", "logra.mode=library", "sync.wire_dtype=fp32"])
    _refused([*SEPARATE, "logra.mode=paper", "logra.update_factor_dtype=fp32",
              "sync.wire_dtype=bf16"], ["logra.update_factor_dtype=fp32"])
    _refused([*SEPARATE, "logra.mode=paper", "sync.mode=full", "sync.wire_dtype=bf16"],
             ["sync.mode=full"])
    load_config(None, [*SEPARATE, "logra.mode=paper", "logra.update_factor_dtype=bf16",
                       "sync.wire_dtype=bf16"]).resolved(1, "rl")


def test_engine_tp_must_divide_the_models_heads_and_widths():
    _refused([*SEPARATE, "model.num_attention_heads=4", "model.num_query_groups=4",
              "rollout.tp=3"], ["model.num_attention_heads=4", "rollout.tp=3"])


def test_top_p_below_one_is_refused_for_a_separate_engine():
    _refused([*SEPARATE, "rl.sampling.top_p=0.9"], ["rl.sampling.top_p=0.9", "untruncated"])
    _refused([*SEPARATE, "rl.eval.top_p=0.5"], ["rl.eval.top_p=0.5"])


def test_a_supervised_run_refuses_a_separate_engine():
    _refused(SEPARATE, ["rollout.placement=separate", "drop it"], command="train")


def test_the_engines_config_keeps_the_model_and_takes_its_own_layout():
    cfg = load_config(None, [*SEPARATE, "parallel.tp=2", "parallel.sp=true", "rollout.tp=1",
                             "rollout.start_timeout_s=1200", "sync.check_interval=1",
                             "sync.transport=collective", "checkpoint.resume=true",
                             "checkpoint.dir=ckpt"]).resolved(2, "rl")
    own = config_from_dict(engine_config(cfg)).resolved(1, "rl")
    assert (own.parallel.tp, own.parallel.pp, own.parallel.dp, own.parallel.sp) == (1, 1, 1,
                                                                                    False)
    # It samples in place: the colocated defaults (its own config accepts nothing inert).
    assert own.rollout == RolloutConfig() and own.sync == SyncConfig()
    assert not own.checkpoint.resume
    assert own.model == cfg.model and own.logra == cfg.logra and own.rl == cfg.rl


def test_rollout_batch_from_engine_responses_keeps_the_share_and_marks_any_stop_finished():
    params = SamplingParams(max_new_tokens=3, temperature=0.7, stop_ids=(9, 8))
    responses = [([4, 9], [-0.5, -0.25]), ([5, 6, 7], [-1.0, -2.0, -3.0]), ([9], [-0.125]),
                 ([3, 8], [-1.0, -0.5])]
    prompts = [[1], [2, 3], [4], [5]]
    batch = rollout_batch(responses, prompts, range(1, 4), params)
    assert batch.sequence_indices == (1, 2, 3)
    assert batch.prompt_tokens == ((2, 3), (4,), (5,))
    assert batch.response_tokens.tolist() == [[5, 6, 7], [9, 0, 0], [3, 8, 0]]
    assert batch.response_lengths.tolist() == [3, 1, 2]
    assert batch.logprobs.tolist() == [[-1.0, -2.0, -3.0], [-0.125, 0.0, 0.0], [-1.0, -0.5, 0.0]]
    assert torch.equal(batch.sampling_logprobs, batch.logprobs)  # top_p = 1: untruncated
    # Either stop token of the set finishes a response.
    assert batch.finished.tolist() == [False, True, True]
    assert batch.logprob_temperature == 0.7
    greedy = rollout_batch(responses, prompts, range(3), SamplingParams(max_new_tokens=3,
                                                                        temperature=0.0))
    assert (greedy.sampling_logprobs == 0).all() and greedy.logprob_temperature == 1.0


def test_rollout_batch_refuses_a_malformed_engine_response():
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(RuntimeError, match="response 0 has 3 tokens and 3 log-probs"):
        rollout_batch([([1, 2, 3], [0.0, 0.0, 0.0])], [[1]], range(1), params)
    with pytest.raises(RuntimeError, match="response 0 has 1 tokens and 2 log-probs"):
        rollout_batch([([1], [0.0, 0.0])], [[1]], range(1), params)


def test_an_engine_token_id_outside_the_tokenizers_vocabulary_is_refused():
    """An engine sampling over padded embedding rows (ids the tokenizer lacks) is stopped where
    its rollouts arrive (on world rank 0, before any rank takes its share), naming the ids, not
    later by a -inf log-prob in the loss."""
    responses = [([4, 5], [-1.0, -1.0]), ([7, 10, 3], [-1.0, -1.0, -1.0])]
    with pytest.raises(RuntimeError, match=r"response 1 holds token id\(s\) \[10\] outside "
                                           "the tokenizer's 10 ids"):
        check_response_ids(responses, vocab_size=10)
    check_response_ids(responses, vocab_size=11)


def test_make_engine_builds_the_megatron_engine_and_names_a_missing_vllm_client(
        tmp_path, monkeypatch):
    cfg = load_config(None, [*SEPARATE, f"run.dir={tmp_path}"])
    engine = make_engine(cfg)
    assert isinstance(engine, MegatronEngine) and isinstance(engine, GenerationEngine)
    monkeypatch.setitem(sys.modules, VLLM_CLIENT_MODULE, None)  # as if the file were absent
    cfg = load_config(None, [*SEPARATE, "rollout.engine=vllm", *LLAMA_STYLE, f"run.dir={tmp_path}"])
    with pytest.raises(RuntimeError, match=r"rollout.engine=vllm needs the vLLM client \(megatron_"
                       r"logra.rollout.vllm_engine\).*use rollout.engine=megatron"):
        make_engine(cfg)


def test_make_engine_builds_vllm_from_the_rollout_config(tmp_path):
    cfg = load_config(None, [*SEPARATE, "rollout.engine=vllm", *LLAMA_STYLE, "rollout.tp=2",
                             "model.params_dtype=bf16", "model.num_layers=2",
                             "rollout.start_timeout_s=123", "rollout.request_timeout_s=45",
                             "rl.seed=7", f"run.dir={tmp_path}"])
    targets = target_param_names(cfg.logra.targets, 2)
    engine = make_engine(cfg, targets)
    assert isinstance(engine, VLLMEngine) and isinstance(engine, GenerationEngine)
    assert engine.hf_dir == tmp_path / "engine" / "hf"  # where the trainer writes the policy
    assert (engine.tensor_parallel, engine.dtype, engine.seed) == (2, "bfloat16", 7)
    assert (engine.start_timeout_s, engine.request_timeout_s) == (123.0, 45.0)
    assert engine.max_model_len == cfg.model.seq_length
    assert engine.target_names == sorted(targets) and engine.weight_layout == "huggingface"


def test_vllm_engine_refuses_a_model_without_a_llama_equivalent_naming_the_field():
    _refused([*SEPARATE, "rollout.engine=vllm", *LLAMA_STYLE, "model.normalization=LayerNorm"],
             ["model.normalization='LayerNorm' with rollout.engine=vllm", "RMSNorm",
              "rollout.engine=megatron"])
