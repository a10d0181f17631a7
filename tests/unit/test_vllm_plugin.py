"""The vLLM plugin's torch-only parts, in our venv (no vLLM needed): its Megatron -> Hugging Face
layout inverts the converter's, its reassembly of vLLM's TP shards inverts vLLM's sharding, and
the engine refuses a protocol or vLLM version it was not built for.

The vLLM engine itself is tested for real in tests/distributed/test_vllm_sync.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.mcore.conversion import (
    HFArchitecture,
    hf_tensors_from_megatron,
    megatron_full_tensor,
)
from megatron_logra.vllm_plugin import VLLM_VERSION
from megatron_logra.vllm_plugin.layout import (
    ServedArch,
    hf_from_vllm_shards,
    hf_tensors,
    target_tp_shard,
    vllm_target_param,
    vllm_target_shard,
)
from megatron_logra.vllm_plugin.server import check_versions

# 4 query heads in 2 groups of width 8: the per-group interleave of linear_qkv is not [q; k; v].
ARCH = HFArchitecture(model_type="llama", num_layers=2, hidden_size=32, num_heads=4,
                      num_kv_heads=2, ffn_hidden_size=48, vocab_size=50, tie_word_embeddings=False,
                      qkv_bias=False, linear_bias=False, rotary_base=10000, norm_eps=1e-5,
                      max_position_embeddings=64)
SERVED = ServedArch(num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=50,
                    tie_word_embeddings=False)
PADDED_VOCAB = 64


def _megatron_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    qkv_rows = (4 + 2 * 2) * 8
    shapes = {"embedding.word_embeddings.weight": (PADDED_VOCAB, 32),
              "output_layer.weight": (PADDED_VOCAB, 32), "decoder.final_layernorm.weight": (32,)}
    for i in range(2):
        p = f"decoder.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (32,), p + "pre_mlp_layernorm.weight": (32,),
                   p + "self_attention.linear_qkv.weight": (qkv_rows, 32),
                   p + "self_attention.linear_proj.weight": (32, 32),
                   p + "mlp.linear_fc1.weight": (96, 32), p + "mlp.linear_fc2.weight": (32, 48)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def test_plugin_layout_inverts_the_converters_hf_to_megatron_mapping():
    """Hugging Face tensors -> Megatron's full tensors (the converter's reader) -> the tensors
    the plugin hands vLLM's loaders: every Hugging Face tensor comes back bit for bit."""
    hf = hf_tensors_from_megatron(_megatron_full(), ARCH)
    full = {name: megatron_full_tensor(name, ARCH, hf.__getitem__, PADDED_VOCAB)
            for name in _megatron_full()}
    got = dict(pair for name, t in full.items() for pair in hf_tensors(name, t, SERVED))
    assert got.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(got[name], tensor), name


def _vllm_shards(hf: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """vLLM's sharding written out for layer 0: rank t holds its query heads and its key /
    value heads stacked [q_t; k_t; v_t], [gate_t; up_t], column slices of o_proj / down_proj and
    a slice of the vocabulary padded to a multiple of 64 per rank."""
    p = "model.layers.0."
    padded = torch.cat([hf["model.embed_tokens.weight"], torch.zeros(PADDED_VOCAB - 50, 32)])

    def rows(t, r):
        return torch.chunk(t, tp)[r]

    return [{
        f"{p}self_attn.qkv_proj.weight": torch.cat(
            [rows(hf[f"{p}self_attn.{x}_proj.weight"], r) for x in "qkv"]),
        f"{p}mlp.gate_up_proj.weight": torch.cat(
            [rows(hf[f"{p}mlp.{x}_proj.weight"], r) for x in ("gate", "up")]),
        f"{p}self_attn.o_proj.weight": torch.chunk(hf[f"{p}self_attn.o_proj.weight"], tp, 1)[r],
        f"{p}mlp.down_proj.weight": torch.chunk(hf[f"{p}mlp.down_proj.weight"], tp, 1)[r],
        "model.embed_tokens.weight": rows(padded, r),
        "model.norm.weight": hf["model.norm.weight"],
    } for r in range(tp)]


@pytest.mark.parametrize("tp", [1, 2])
def test_reassembly_of_vllm_tp_shards_inverts_vllms_sharding(tp):
    hf = hf_tensors_from_megatron(_megatron_full(), ARCH)
    got = hf_from_vllm_shards(_vllm_shards(hf, tp), SERVED)
    for name, tensor in got.items():
        assert torch.equal(tensor, hf[name]), name
    assert len(got) == 9  # q, k, v, gate, up, o, down, embeddings, norm


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_tp_shard_of_each_target_is_the_vllm_ranks_parameter_in_vllms_row_order(tp):
    """What a worker's sharded shadow writes into its own parameter: Megatron's TP shard of the
    full tensor (from the parameter's local shape), re-stacked, equals vLLM's shard of it."""
    full = _megatron_full()
    shards = _vllm_shards(hf_tensors_from_megatron(full, ARCH), tp)
    targets = [f"decoder.layers.0.{s}.weight" for s in (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
        "mlp.linear_fc2")]
    for rank in range(tp):
        for name in targets:
            param = shards[rank][vllm_target_param(name)]
            shard = target_tp_shard(name, param.shape, rank, tp, SERVED)
            assert torch.equal(vllm_target_shard(name, shard.take(full[name]), SERVED, tp),
                               param), (rank, name)
    with pytest.raises(ValueError, match="engine TP=4 replicates key/value heads"):
        target_tp_shard(targets[0], (16, 32), 0, 4, SERVED)


def test_engine_refuses_another_sync_protocol_or_vllm_version_naming_both():
    check_versions(1, 1, VLLM_VERSION)
    check_versions(1, 1, f"{VLLM_VERSION}+cpu")
    with pytest.raises(RuntimeError, match="sync protocol mismatch: the trainer speaks version 2"):
        check_versions(2, 1, VLLM_VERSION)
    with pytest.raises(RuntimeError, match=f"written for vLLM {VLLM_VERSION}, the venv has 0.31.0"):
        check_versions(1, 1, "0.31.0")


class _FailingModel(torch.nn.Module):
    """vLLM's model as far as a sync's load reaches it: ``load_weights`` of a name it does not
    hold raises, as vLLM's loaders do (a KeyError of the parameter dict)."""

    def load_weights(self, weights):
        for name, _ in weights:
            raise KeyError(name)


def test_a_record_the_model_fails_to_load_leaves_the_worker_refusing_all_but_a_full_sync():
    # Issue 21 item 10: the shadow took the record before the load raised, so shadow and served
    # model disagreed and the next records were accepted on top of the stale model.
    from types import SimpleNamespace

    from megatron_logra.sync.records import DenseUpdate, full_sync_buckets
    from megatron_logra.sync.shadow import EngineShadow
    from megatron_logra.sync.wire import encode
    from megatron_logra.vllm_plugin.extension import LowRankSyncExtension

    norm = "decoder.final_layernorm.weight"
    worker = LowRankSyncExtension()
    worker._logra_shadow = EngineShadow([], served_dtype=torch.float32)
    worker._logra_targets, worker._logra_arch, worker._logra_tp = {}, SERVED, 1
    worker.model_runner = SimpleNamespace(model=_FailingModel())
    (bucket,) = full_sync_buckets({norm: torch.ones(32)}, update_count=0, bucket_bytes=1 << 20)
    status, message = worker.megatron_logra_apply(encode(bucket, wire_dtype="fp32"))
    assert status == "error" and "refuses every record until a full sync" in message
    later = DenseUpdate(norm, 1, torch.full((32,), 2.0))
    status, message = worker.megatron_logra_apply(encode(later, wire_dtype="fp32"))
    assert status == "error" and f"unknown parameter {norm}" in message


def test_the_engine_start_timeout_default_exceeds_the_recorded_vllm_start_times():
    # Issue 21 item 10: 300 s was below the 156-315 s starts recorded on a loaded machine.
    from megatron_logra.config.rollout import RolloutConfig
    from megatron_logra.rollout.vllm_engine import DEFAULT_START_TIMEOUT_S

    recorded_max_start_s = 315.0  # docs/vllm.md
    assert RolloutConfig().start_timeout_s == DEFAULT_START_TIMEOUT_S > 2 * recorded_max_start_s
