"""Hugging Face Qwen3-MoE, Qwen3 and Qwen2-MoE <-> Megatron (tools/convert_hf.py) on tiny
models made here.

Three tiny models are created with random weights (transformers, no download) and saved with
save_pretrained, fp32:

* ``qwen3_moe``: 2 layers, every one MoE with 4 experts of width 24, top-2 with
  ``norm_topk_prob=true``, no shared expert, q/k RMSNorms, grouped-query attention (4 heads in
  2 groups of width 8), untied embeddings, rope_theta 1e6;
* ``qwen3``: the dense family (q/k norms, tied embeddings);
* ``qwen2_moe``: 4 experts top-2 with ``norm_topk_prob=false`` (Megatron's pre-softmax
  router), a shared expert of width 40 with its sigmoid gate, q/k/v biases, no q/k norms.

Weights are drawn wide (std 0.2, norm gains 1 +- 0.3, router included) so that routing is far
from uniform and every expert gets tokens: a wrong expert order, router or q/k norm shows in the
logits. ``to-megatron`` converts them; the Megatron logits come from ``build_model_chunks`` +
``load_model_weights`` through Megatron's forward-only schedule (``workers/hf_logits_worker.py``)
and are compared with transformers' (eager attention) on the same tokens; ``to-hf`` writes them
back, tensor for tensor and byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.torchrun import REPO, WORKERS, run_torchrun

pytestmark = pytest.mark.distributed

CONVERT = str(REPO / "tools" / "convert_hf.py")
WORKER = str(WORKERS / "hf_logits_worker.py")
BATCH, SEQ, VOCAB = 2, 16, 120
TOOL_TIMEOUT_S = 600
LOGIT_MAX_ABS_TOL = 1e-4
"""fp32 logits of magnitude ~5: our sdpa kernel and the experts' matmuls sum in another order
than transformers' eager attention and grouped experts (measured max |diff| 2.4e-6 for
qwen3_moe, 2.6e-6 for qwen3, 2.2e-6 for qwen2_moe); 1e-4 is ~40x that, and a swapped gate/up
half, a wrong expert index, a missing q/k norm or shared-expert gate, or the other softmax
moves the logits by O(1)."""


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    from transformers import (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    root = tmp_path_factory.mktemp("hf_qwen3")
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 max_position_embeddings=64, rms_norm_eps=1e-6, dtype="float32",
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    specs = {
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
            **shape, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True, tie_word_embeddings=False)),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**shape, tie_word_embeddings=True)),
        "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(
            **{k: v for k, v in shape.items() if k != "head_dim"}, moe_intermediate_size=24,
            shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=False, tie_word_embeddings=False)),
    }
    paths = {}
    for seed, (name, (cls, config)) in enumerate(specs.items()):
        torch.manual_seed(seed)
        model = cls(config)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(1.0 + 0.3 * noise if "norm" in param_name else 0.2 * noise)
        model.save_pretrained(root / name)
        paths[name] = root / name
    return paths


@pytest.fixture(scope="module")
def converted(hf_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("megatron_qwen3")
    out = {}
    for name, path in hf_models.items():
        out[name] = root / name
        run_torchrun(1, [CONVERT, "to-megatron", str(path), str(out[name])],
                     timeout_s=TOOL_TIMEOUT_S)
    return out


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokens_qwen3") / "tokens.pt"
    torch.save(torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7)),
               path)
    return path


def _hf_logits(model_dir: Path, tokens: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.load(tokens)).logits.float()


def test_derived_config_has_qk_norms_and_the_experts(converted):
    import yaml

    moe = yaml.safe_load((converted["qwen3_moe"] / "model.yaml").read_text())["model"]
    assert (moe["qk_layernorm"], moe["num_moe_experts"], moe["moe_router_topk"],
            moe["moe_ffn_hidden_size"], moe["moe_layer_freq"]) == (True, 4, 2, 24, 1)
    assert not moe["moe_router_pre_softmax"] and moe["moe_shared_expert_ffn_hidden_size"] is None
    dense = yaml.safe_load((converted["qwen3"] / "model.yaml").read_text())["model"]
    assert dense["qk_layernorm"] and dense["num_moe_experts"] is None
    qwen2 = yaml.safe_load((converted["qwen2_moe"] / "model.yaml").read_text())["model"]
    assert (qwen2["qk_layernorm"], qwen2["moe_router_pre_softmax"],
            qwen2["moe_shared_expert_ffn_hidden_size"], qwen2["moe_shared_expert_gate"],
            qwen2["add_qkv_bias"]) == (False, True, 40, True, True)


def test_megatron_logits_match_transformers_for_qwen3_moe_and_qwen3(
        hf_models, converted, tokens, tmp_path):
    run_torchrun(1, [WORKER, "--converted", *(str(converted[n]) for n in hf_models),
                     "--tokens", str(tokens), "--tp", "1", "--pp", "1", "--out", str(tmp_path)])
    for name in hf_models:
        ours, ref = torch.load(tmp_path / f"{name}.pt"), _hf_logits(hf_models[name], tokens)
        assert ours.shape == ref.shape
        assert float((ours - ref).abs().max()) <= LOGIT_MAX_ABS_TOL, name


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_every_expert_of_the_reference_receives_tokens(hf_models, tokens, name):
    """The logits comparison covers every expert: each is routed some of the test tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_models[name], local_files_only=True,
                                                 attn_implementation="eager").eval()
    chosen: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: chosen.append(out[2]))
             for layer in model.model.layers]
    with torch.no_grad():
        model(torch.load(tokens))
    for hook in hooks:
        hook.remove()
    assert len(chosen) == 2
    for indices in chosen:
        assert set(indices.flatten().tolist()) == set(range(4))


def test_megatron_to_hf_round_trip_is_bit_exact(hf_models, converted, tmp_path):
    for name, source in hf_models.items():
        back = tmp_path / name
        run_torchrun(1, [CONVERT, "to-hf", str(converted[name]), str(back)],
                     timeout_s=TOOL_TIMEOUT_S)
        original = load_file(source / "model.safetensors")
        written = load_file(back / "model.safetensors")
        assert sorted(written) == sorted(original), name
        for tensor_name, tensor in original.items():
            assert written[tensor_name].dtype == tensor.dtype
            assert torch.equal(written[tensor_name], tensor), (name, tensor_name)
        assert json.loads((back / "config.json").read_text()) == json.loads(
            (source / "config.json").read_text())
