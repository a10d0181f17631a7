"""Hugging Face <-> Megatron conversion (tools/convert_hf.py) on tiny models made here.

Three tiny Hugging Face models are created with random weights and saved with save_pretrained:

* ``qwen``: Qwen2 with q/k/v biases, tied embeddings, grouped-query attention (4 heads in 2
  groups), rope_theta 1e6, rms_norm_eps 1e-6, fp32;
* ``llama``: Llama with untied embeddings, no biases, multi-head attention, rope_theta 5e5,
  rms_norm_eps 1e-5, a vocabulary of 250 (Megatron pads it to 256), fp32;
* ``llama_bf16``: the Llama shape stored in bf16.

Weights are drawn wide enough (std 0.2, random biases and norm gains) that attention is far from
uniform, so a wrong rotary base, head order or norm epsilon shows in the logits.

The Megatron logits come from ``build_model_chunks`` + ``load_model_weights`` (what a training
run does with ``model.init_checkpoint``) at TP=1 and at TP=2 / PP=2, through Megatron's
forward-only pipeline schedule (``workers/hf_logits_worker.py``); the reference is the
``transformers`` model on the same tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.presets import tiny_width
from tests.torchrun import REPO, WORKERS, run_torchrun, torchrun_env

pytestmark = pytest.mark.distributed

CONVERT = str(REPO / "tools" / "convert_hf.py")
WORKER = str(WORKERS / "hf_logits_worker.py")
BATCH, SEQ = 2, 16
TOOL_TIMEOUT_S = 600
# fp32 logits of magnitude up to ~7. At TP=1 with model.attention=local our model runs the same
# operations as transformers' eager attention (measured max |diff| 0.0); the default sdpa's fused
# kernel sums in another order (measured 6.2e-6 for qwen, 5.1e-6 for llama); at TP=2 / PP=2 the
# matmuls are split over ranks and summed in a different order (measured 4.6e-6 for qwen, 5.8e-6
# for llama, with local attention). 1e-4 is ~20x the measured
# error and ~50000x below what a wrong rotary base does (5.6; see the negative control).
LOGIT_MAX_ABS_TOL = 1e-4
# Shard limit for the sharded-output round trip: the tiny llama's tensors are 6-64 KB, so
# this splits its 21 tensors over several files.
SMALL_SHARD_BYTES = 60_000


def _tokenizer(directory: Path) -> None:
    """A tiny BPE tokenizer (smaller than the models' vocabularies) saved next to a model."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<eos>", "<pad>"])
    tokenizer.train_from_iterator(["What is 12 plus 7? 19", "Compute 45 minus 3. 42"] * 20,
                                  trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(directory)


@torch.no_grad()
def _widen(model: torch.nn.Module, seed: int) -> None:
    """Random biases and norm gains (transformers initialises them to 0 and 1)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
        elif "norm" in name:
            param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("hf")
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=128, initializer_range=0.2)
    specs = {
        "qwen": (Qwen2ForCausalLM, Qwen2Config(
            **shape, vocab_size=256, num_key_value_heads=2, tie_word_embeddings=True,
            rope_theta=1e6, rms_norm_eps=1e-6), torch.float32),
        "llama": (LlamaForCausalLM, LlamaConfig(
            **shape, vocab_size=250, num_key_value_heads=4, tie_word_embeddings=False,
            rope_theta=5e5, rms_norm_eps=1e-5), torch.float32),
        "llama_bf16": (LlamaForCausalLM, LlamaConfig(
            **shape, vocab_size=250, num_key_value_heads=4, tie_word_embeddings=False,
            rope_theta=5e5, rms_norm_eps=1e-5), torch.bfloat16),
    }
    paths = {}
    for seed, (name, (cls, config, dtype)) in enumerate(specs.items()):
        torch.manual_seed(seed)
        model = cls(config)
        _widen(model, seed)
        model.to(dtype).save_pretrained(root / name)
        _tokenizer(root / name)
        paths[name] = root / name
    return paths


def _tool(*args: str) -> None:
    """``python tools/convert_hf.py ARGS`` as a one-rank job (run_torchrun: a fork that has
    Megatron imported already); the tool reads a world of one from the environment, which is
    what it assumes without one. Raises with the tool's output if it fails."""
    run_torchrun(1, [CONVERT, *args], timeout_s=TOOL_TIMEOUT_S)


def _tool_process(*args: str) -> None:
    """The tool as a process of its own: for a multi-rank layout it launches torchrun itself."""
    result = subprocess.run([sys.executable, CONVERT, *args], cwd=REPO, env=torchrun_env(),
                            capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    if result.returncode != 0:
        raise AssertionError(f"convert_hf {' '.join(args)} exited {result.returncode}:\n"
                             f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}")


@pytest.fixture(scope="module")
def converted(hf_models, tmp_path_factory) -> dict[str, Path]:
    """to-megatron outputs: each model at TP=1, and qwen written at TP=2 / PP=2 as well."""
    root = tmp_path_factory.mktemp("megatron")
    out = {}
    for name, path in hf_models.items():
        out[name] = root / name
        _tool("to-megatron", str(path), str(out[name]))
    out["qwen_tp2_pp2"] = root / "qwen_tp2_pp2"
    _tool_process("to-megatron", str(hf_models["qwen"]), str(out["qwen_tp2_pp2"]), "parallel.tp=2",
          "parallel.pp=2")
    return out


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokens") / "tokens.pt"
    generator = torch.Generator().manual_seed(7)
    # Below 250: valid for both vocabularies.
    torch.save(torch.randint(0, 250, (BATCH, SEQ), generator=generator), path)
    return path


def _megatron_logits(converted, tokens, tmp_path_factory, tp: int, pp: int) -> dict[str, Path]:
    out = tmp_path_factory.mktemp(f"logits_tp{tp}_pp{pp}")
    run_torchrun(tp * pp, [WORKER, "--converted", str(converted["qwen"]), str(converted["llama"]),
                           "--tokens", str(tokens), "--tp", str(tp), "--pp", str(pp),
                           "--out", str(out)])
    return {name: out / f"{name}.pt" for name in ("qwen", "llama")}


@pytest.fixture(scope="module")
def logits_tp1(converted, tokens, tmp_path_factory) -> dict[str, Path]:
    return _megatron_logits(converted, tokens, tmp_path_factory, 1, 1)


@pytest.fixture(scope="module")
def logits_tp2_pp2(converted, tokens, tmp_path_factory) -> dict[str, Path]:
    return _megatron_logits(converted, tokens, tmp_path_factory, 2, 2)


def _hf_logits(model_dir: Path, tokens_path: Path, **config_changes) -> torch.Tensor:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    for key, value in config_changes.items():
        if key == "rope_theta":
            config.rope_parameters["rope_theta"] = value
        else:
            setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, local_files_only=True, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(torch.load(tokens_path)).logits.float()


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


# ----------------------------------------------------------------------------- config


def test_derived_model_config_carries_the_hf_architecture(hf_models, converted):
    expected = {
        "qwen": dict(num_query_groups=2, rotary_base=1_000_000, layernorm_epsilon=1e-6,
                     add_qkv_bias=True, add_bias_linear=False, untie_embeddings=False,
                     params_dtype="fp32"),
        "llama": dict(num_query_groups=None, rotary_base=500_000, layernorm_epsilon=1e-5,
                      add_qkv_bias=False, add_bias_linear=False, untie_embeddings=True,
                      params_dtype="fp32"),
        "llama_bf16": dict(num_query_groups=None, rotary_base=500_000, layernorm_epsilon=1e-5,
                           add_qkv_bias=False, add_bias_linear=False, untie_embeddings=True,
                           params_dtype="bf16"),
    }
    for name, fields in expected.items():
        model = yaml.safe_load((converted[name] / "model.yaml").read_text())["model"]
        hf = json.loads((hf_models[name] / "config.json").read_text())
        assert model["num_layers"] == hf["num_hidden_layers"]
        assert model["hidden_size"] == hf["hidden_size"]
        assert model["num_attention_heads"] == hf["num_attention_heads"]
        assert model["ffn_hidden_size"] == hf["intermediate_size"]
        assert (model["normalization"], model["activation"], model["position_embedding"]) == (
            "RMSNorm", "swiglu", "rope")
        assert {key: model[key] for key in fields} == fields, name
        assert model["init_checkpoint"] == str((converted[name] / "model").resolve())


def test_to_megatron_copies_the_tokenizer_files_and_generation_config_unchanged(hf_models,
                                                                             converted):
    for name in hf_models:
        copied = sorted(p.name for p in (converted[name] / "tokenizer").iterdir())
        # The model's generation config goes beside the tokenizer: its stop tokens.
        generation = ["generation_config.json"] * (hf_models[name] / "generation_config.json"
                                                   ).is_file()
        assert copied == sorted(["tokenizer.json", "tokenizer_config.json", *generation])
        for file in copied:
            assert (converted[name] / "tokenizer" / file).read_bytes() == (
                hf_models[name] / file).read_bytes()


# ----------------------------------------------------------------------------- logits


def test_megatron_logits_match_hf_logits_at_tp1(hf_models, logits_tp1, tokens):
    for name in ("qwen", "llama"):
        diff = _max_abs(torch.load(logits_tp1[name]), _hf_logits(hf_models[name], tokens))
        assert diff <= LOGIT_MAX_ABS_TOL, (name, diff)


def test_megatron_logits_match_hf_logits_at_tp2_pp2(hf_models, logits_tp2_pp2, tokens):
    # Loaded from the checkpoint written at TP=1: resharded to TP=2 / PP=2 on load.
    for name in ("qwen", "llama"):
        diff = _max_abs(torch.load(logits_tp2_pp2[name]), _hf_logits(hf_models[name], tokens))
        assert diff <= LOGIT_MAX_ABS_TOL, (name, diff)


def test_logit_tolerance_rejects_a_model_with_another_rotary_base(hf_models, logits_tp1, tokens):
    # Negative control: the same weights with transformers' default rope_theta are far outside
    # the parity tolerance, so the parity tests would catch a rotary base dropped on the way.
    for name in ("qwen", "llama"):
        wrong = _hf_logits(hf_models[name], tokens, rope_theta=10000.0)
        assert _max_abs(torch.load(logits_tp1[name]), wrong) > 1000 * LOGIT_MAX_ABS_TOL, name


# ----------------------------------------------------------------------------- round trip


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _assert_bitwise_equal(original: dict[str, torch.Tensor], back: dict[str, torch.Tensor]):
    assert sorted(back) == sorted(original)
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype, key
        assert back[key].shape == tensor.shape, key
        assert torch.equal(back[key], tensor), key


def _assert_transformers_loads(directory: Path) -> None:
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True,
                                                   output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys",
                                         "error_msgs")), info


@pytest.mark.parametrize(
    ("source", "converted_name", "extra"),
    [
        ("qwen", "qwen", []),
        ("qwen", "qwen_tp2_pp2", []),
        ("llama", "llama", ["--max-shard-bytes", str(SMALL_SHARD_BYTES)]),
        ("llama_bf16", "llama_bf16", []),
    ],
)
def test_round_trip_hf_megatron_hf_is_bitwise_exact_and_loads_in_transformers(
    hf_models, converted, tmp_path, source, converted_name, extra
):
    out = tmp_path / "hf"
    _tool("to-hf", str(converted[converted_name]), str(out), *extra)
    _assert_bitwise_equal(_safetensors(hf_models[source]), _safetensors(out))
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (hf_models[source] / "config.json").read_text())
    if extra:
        assert (out / "model.safetensors.index.json").is_file()
        assert len(list(out.glob("model-*.safetensors"))) > 1
    _assert_transformers_loads(out)


def test_to_hf_of_a_bare_checkpoint_derives_a_config_with_the_same_logits(
    hf_models, converted, tokens, tmp_path
):
    # A checkpoint directory on its own (as a training run writes it): no hf_source.json, so
    # config.json is derived from the checkpoint's model config, with the padded vocabulary.
    out = tmp_path / "hf"
    _tool("to-hf", str(converted["llama"] / "model"), str(out))
    derived = json.loads((out / "config.json").read_text())
    assert derived["model_type"] == "llama"
    assert derived["vocab_size"] == 256
    logits = _hf_logits(out, tokens)
    reference = _hf_logits(hf_models["llama"], tokens)
    assert _max_abs(logits[..., :250], reference) <= LOGIT_MAX_ABS_TOL
    # Megatron's padding rows are zero: their logits are exactly 0.
    assert torch.count_nonzero(logits[..., 250:]) == 0


def test_to_hf_of_a_training_checkpoint_holds_the_trained_weights_and_loads(
    synthetic_data_dir, tmp_path
):
    # A LoGRA run at TP=2 writes a training checkpoint (model, optimizer and LoGRA state) and
    # its own gathered full weights; the exported tensors, mapped back, are those weights.
    from safetensors.torch import load_file

    from megatron_logra.mcore.conversion import (
        architecture_from_hf_config,
        megatron_full_tensor,
    )

    run_dir, ckpt_dir, out = tmp_path / "run", tmp_path / "ckpt", tmp_path / "hf"
    run_torchrun(2, ["-m", "megatron_logra", "train", str(REPO / "configs" / "demo_cpu.yaml"),
                     "optimizer.name=logra", "optimizer.lr_warmup_steps=0", "train.steps=1",
                     *tiny_width(),
                     f"data.dir={synthetic_data_dir}", f"run.dir={run_dir}",
                     "run.save_full_weights=true", f"checkpoint.dir={ckpt_dir}"])
    _tool("to-hf", str(ckpt_dir / "iter_0000001"), str(out))
    arch = architecture_from_hf_config(json.loads((out / "config.json").read_text()))
    exported = load_file(out / "model.safetensors")
    trained = torch.load(run_dir / "full_weights.pt")
    padded = trained["embedding.word_embeddings.weight"].shape[0]
    for name, tensor in trained.items():
        assert torch.equal(megatron_full_tensor(name, arch, exported.__getitem__, padded),
                           tensor), name
    _assert_transformers_loads(out)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mistral"}, "model_type='mistral' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"head_dim": 32}, "head_dim=32 differs"),
        ({"attention_bias": True}, "attention_bias=True with mlp_bias=False"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}},
         "'linear' rotary scaling"),
    ],
)
def test_unrepresentable_llama_configs_are_refused_with_the_field_named(hf_models, change, message):
    from megatron_logra.mcore.conversion import architecture_from_hf_config

    config = json.loads((hf_models["llama"] / "config.json").read_text())
    config.update(change)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        architecture_from_hf_config(config)


def test_sliding_window_qwen_is_refused(hf_models):
    from megatron_logra.mcore.conversion import architecture_from_hf_config

    config = json.loads((hf_models["qwen"] / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=64)
    with pytest.raises(ValueError, match="use_sliding_window=true"):
        architecture_from_hf_config(config)


def test_to_megatron_refuses_an_override_that_would_change_the_weights(hf_models, tmp_path):
    result = subprocess.run(
        [sys.executable, CONVERT, "to-megatron", str(hf_models["qwen"]), str(tmp_path / "out"),
         "model.hidden_size=32"],
        cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=TOOL_TIMEOUT_S,
    )
    assert result.returncode == 2, result.stderr
    assert "override 'model.hidden_size=32' is not accepted" in result.stderr
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- training from it

PROBLEMS = [(f"What is {a} plus {b}?", str(a + b)) for a, b in
            [(12, 7), (45, 3), (19, 4), (7, 12), (3, 45), (4, 19), (9, 5), (5, 9)]]
# The converted qwen at TP=2 against transformers, both fp32: the logits agree to ~5e-6 (see
# LOGIT_MAX_ABS_TOL); a mean cross-entropy of ~5 nats then agrees to ~1e-6 relative.
SFT_LOSS_REL_TOL = 1e-5


def _prompt_data(directory: Path) -> Path:
    directory.mkdir()
    for split in ("train", "eval"):
        with (directory / f"{split}.jsonl").open("w") as out:
            for prompt, answer in PROBLEMS:
                out.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
    return directory


def _run_config(converted_dir: Path, path: Path) -> Path:
    model = yaml.safe_load((converted_dir / "model.yaml").read_text())["model"]
    config = {
        "model": {**model, "seq_length": 32},
        "parallel": {"device": "cpu"},
        "optimizer": {"name": "logra", "lr": 1e-3, "lr_warmup_steps": 0},
        "logra": {"sketch_rank": 8},
        "train": {"steps": 1, "micro_batch_size": 4},
        "data": {"format": "prompts", "tokenizer": str(converted_dir / "tokenizer")},
        "rl": {"prompts_per_step": 4, "sampling": {"max_new_tokens": 4},
               "eval": {"interval": 0, "prompts": 4, "samples": 1}},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _hf_answer_loss(model_dir: Path, tokenizer_dir: Path) -> float:
    """Mean cross-entropy of transformers' model on the answer tokens and EOS of every problem."""
    from transformers import AutoModelForCausalLM

    from megatron_logra.config import PromptConfig
    from megatron_logra.data.hf_tokenizer import HFTokenizer
    from megatron_logra.data.prompt_builder import PromptBuilder
    from megatron_logra.data.prompt_data import PromptProblem

    builder = PromptBuilder(HFTokenizer(tokenizer_dir), PromptConfig())
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                 dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, answer in PROBLEMS:
            ids, prompt_len = builder.supervised_tokens(PromptProblem(prompt, answer))
            logits = model(torch.tensor([ids])).logits[0].double()
            targets = torch.tensor(ids[prompt_len:])
            losses = torch.nn.functional.cross_entropy(logits[prompt_len - 1 : -1], targets,
                                                       reduction="none")
            total, count = total + float(losses.sum()), count + len(targets)
    return total / count


def test_sft_from_a_converted_model_with_its_tokenizer_starts_at_the_hf_loss(
    hf_models, converted, tmp_path
):
    # The converted qwen (256 rows, a tokenizer of ~100 ids) trains at TP=2 on prompt data
    # encoded by its own tokenizer: the first step's loss is transformers' loss on those tokens.
    from megatron_logra.train.metrics import read_metrics

    data = _prompt_data(tmp_path / "data")
    config = _run_config(converted["qwen"], tmp_path / "run.yaml")
    # The SFT batch is every problem; an RL batch is its rollouts (rl.prompts_per_step).
    run_torchrun(2, ["-m", "megatron_logra", "sft", str(config), "parallel.tp=2",
                     f"train.global_batch_size={len(PROBLEMS)}", f"data.dir={data}",
                     f"run.dir={tmp_path / 'sft'}"])
    loss = read_metrics(tmp_path / "sft" / "metrics.jsonl")[0]["loss"]
    want = _hf_answer_loss(hf_models["qwen"], converted["qwen"] / "tokenizer")
    assert abs(loss - want) <= SFT_LOSS_REL_TOL * want, (loss, want)


def test_rl_from_a_converted_model_with_its_tokenizer_takes_a_kl_controlled_step(converted,
                                                                                 tmp_path):
    # The embedding keeps the checkpoint's 256 rows while rollouts, the policy log-probs and the
    # KL probe use the tokenizer's ~100 ids (test_sampler shows ids beyond them are never drawn).
    import math

    from megatron_logra.data.hf_tokenizer import HFTokenizer
    from megatron_logra.train.metrics import read_metrics

    data = _prompt_data(tmp_path / "data")
    config = _run_config(converted["qwen"], tmp_path / "run.yaml")
    run_torchrun(1, ["-m", "megatron_logra", "rl", str(config), f"data.dir={data}",
                     "logra.kl_control.enabled=true", "logra.kl_control.probe_responses=4",
                     f"run.dir={tmp_path / 'rl'}"])
    assert HFTokenizer(converted["qwen"] / "tokenizer").vocab_size < 256
    record = read_metrics(tmp_path / "rl" / "metrics.jsonl")[-1]
    assert record["step"] == 1
    for field in ("loss", "reward", "alpha", "kl_predicted", "kl_realized"):
        assert math.isfinite(record[field]), (field, record[field])
    assert record["alpha"] > 0.0
