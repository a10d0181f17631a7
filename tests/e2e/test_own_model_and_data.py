"""README's "Your own model and data" commands, run as written on a real architecture.

A tiny Qwen2 (random weights) and a tokenizer with a Qwen-style chat template are built here with
transformers / tokenizers (``<|endoftext|>`` as EOS, as in Qwen2.5's base models; ``<|im_end|>``
closing turns; ``generation_config.eos_token_id = [<|im_end|>, <|endoftext|>]``), and a GSM8K-style
dataset is written in GSM8K's own format. The commands of the README section are read from
README.md and run in order with the paths replaced by temporary ones, one process instead of 8,
and a scaled-down shape appended (CPU, a short seq_length and few steps; the architecture is the
tiny model's, from the converter's model.yaml after the preset):

prepare_dataset gsm8k -> convert_hf to-megatron -> sft (on the worked solutions) -> rl with the
built-in sampler -> rl with vLLM -> convert_hf to-hf.

Both RL runs start from the same warm start with the preset's chat template, system prompt and
math-verify reward. Claims: the first rollout's prompt ids are identical in both runs and are
transformers' ``apply_chat_template`` ids of ``[system, user]`` with the generation prompt; the
warm-started greedy responses of both engines are the same, stop at ``<|im_end|>`` and are graded
correct by math-verify; every response that ended carries a stop token; the final model
converts to a Hugging Face directory transformers loads with its tokenizer, chat template,
generation config (the stop-token list) and the source model's positions.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_logra.rl.eval_answers import eval_answers_path, read_eval_answers
from megatron_logra.train.metrics import read_metrics
from megatron_logra.train.rl.rollout_log import read_rollouts
from tests.chat_tokenizer import EOS, IM_END, save_chat_tokenizer
from tests.torchrun import REPO, run_torchrun, torchrun_env

pytestmark = pytest.mark.distributed

SECTION = "### Your own model and data"
# The README's placeholders -> this test's directories (keys of the tmp layout below).
PLACES = {"~/datasets/gsm8k": "raw", "~/models/Qwen2.5-1.5B-Instruct": "hf", ".data/gsm8k": "data",
          "ckpt/qwen1.5b": "ckpt", "runs/": "runs/"}
SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
MAX_POSITIONS = 512
# Small sums in GSM8K's format (calculator annotation, "#### N"), all of 5: a 2-layer model's
# short warm start learns the answer format, the box and the stop token, not arithmetic, so
# only a shared answer makes its greedy answers right. The held-out split repeats two of them.
SUMS = [(2, 3), (4, 1), (1, 4), (3, 2), (0, 5), (5, 0), (2, 3), (1, 4)]
# What one process at toy scale needs on top of the README command (the model itself comes from
# model.yaml): CPU, lengths for ~70-token prompts, few steps, small batches, no LoGRA width
# beyond the tiny model's, fp32 masters for the fp32 model, one grading worker.
COMMON = ["parallel.device=cpu", "model.seq_length=128", "model.recompute=none",
          "logra.sketch_rank=16", "logra.master_weights=auto", "optimizer.lr_warmup_steps=0"]
SCALE = {
    "sft": [*COMMON, "optimizer.name=adam", "optimizer.lr=3e-3", "train.steps=60",
            "train.micro_batch_size=8", "train.global_batch_size=8"],
    "rl": [*COMMON, "train.steps=1", "train.micro_batch_size=4", "train.global_batch_size=4",
           "rl.prompts_per_step=4",
           "rl.sampling.max_new_tokens=40", "rl.eval.prompts=2", "rl.eval.samples=1",
           "rl.eval.interval=0", "rl.reward.math_verify.num_workers=1",
           "rollout.start_timeout_s=900", "run.save_full_weights=true"],
}
TOOL_TIMEOUT_S = 600
RUN_TIMEOUT_S = 1200


def readme_commands() -> list[list[str]]:
    """The shell commands of the README section's code block, continuation lines joined."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(SECTION):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _tiny_qwen(directory: Path, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    im_end, eos = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id
    torch.manual_seed(0)
    # Head width 32: the smallest CPU vLLM's attention takes.
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
                         rope_theta=1e6, rms_norm_eps=1e-6, eos_token_id=eos,
                         bos_token_id=eos)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    GenerationConfig(eos_token_id=[im_end, eos], bos_token_id=eos).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _gsm8k(directory: Path) -> None:
    directory.mkdir(parents=True)
    rows = [{"question": f"What is {a} plus {b}?",
             "answer": f"{a}+{b}=<<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"} for a, b in SUMS]
    (directory / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))


def _run(argv: list[str], places: dict[str, Path]) -> None:
    """One README command with its paths replaced and the scale-down appended."""

    def place(arg: str) -> str:
        for text, key in PLACES.items():
            arg = arg.replace(text, str(places[key]) + ("/" if text.endswith("/") else ""))
        return arg

    argv = [place(arg) for arg in argv]
    if argv[0] == "torchrun":
        start = argv.index("-m")
        command = argv[start + 2]
        run_torchrun(1, [*argv[start:], *SCALE[command]], timeout_s=RUN_TIMEOUT_S)
    elif argv[:2] == ["python", "tools/convert_hf.py"]:
        # A fork of a process that imported Megatron already (cheaper than a fresh one).
        run_torchrun(1, [str(REPO / argv[1]), *argv[2:]], timeout_s=TOOL_TIMEOUT_S)
    else:
        assert argv[0] == "python", argv
        result = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, env=torchrun_env(),
                                capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
        assert result.returncode == 0, result.stderr


@pytest.fixture(scope="session")
def readme_runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("own_model")
    places = {"raw": root / "gsm8k_raw", "hf": root / "hf", "data": root / "data",
              "ckpt": root / "ckpt", "runs/": root / "runs"}
    save_chat_tokenizer(root / "tokenizer")
    _tiny_qwen(places["hf"], root / "tokenizer")
    _gsm8k(places["raw"])
    for argv in readme_commands():
        _run(argv, places)
    return {**places, "sampler": places["runs/"] / "rl", "vllm": places["runs/"] / "rl_vllm"}


def test_readme_section_is_prepare_convert_sft_rl_rl_with_vllm_and_back():
    shapes = [(a[0], a[1] if a[0] == "python" else a[a.index("-m") + 2]) for a in
              readme_commands()]
    assert shapes == [("python", "tools/prepare_dataset.py"), ("python", "tools/convert_hf.py"),
                      ("torchrun", "sft"), ("torchrun", "rl"), ("torchrun", "rl"),
                      ("python", "tools/convert_hf.py")]
    vllm = readme_commands()[4]
    assert "rollout.engine=vllm" in vllm and "rollout.placement=separate" in vllm


def _math_verify(answer: str, response: str) -> bool:
    from math_verify import parse, verify

    return bool(verify(parse(f"\\boxed{{{answer}}}"), parse(response)))


def _first_rollout(run: Path) -> dict:
    (record,) = [r for r in read_rollouts(run) if r["step"] == 1 and r["index"] == 0]
    return record


def test_first_rollout_prompt_ids_are_the_chat_template_ids_and_equal_for_sampler_and_vllm(
        readme_runs):
    from transformers import AutoTokenizer

    sampler, vllm = _first_rollout(readme_runs["sampler"]), _first_rollout(readme_runs["vllm"])
    assert sampler["prompt_ids"] == vllm["prompt_ids"]
    tokenizer = AutoTokenizer.from_pretrained(str(readme_runs["hf"]), local_files_only=True)
    question = next(json.loads(line)["prompt"] for line in
                    (readme_runs["data"] / "train.jsonl").read_text().splitlines()
                    if json.loads(line)["prompt"] in sampler["prompt"])
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        tokenize=True, add_generation_prompt=True)["input_ids"]
    assert sampler["prompt_ids"] == list(expected)


def test_vllm_and_the_sampler_stop_at_im_end_in_the_same_place_and_math_verify_grades_it(
        readme_runs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(readme_runs["hf"]), local_files_only=True)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    stops = {im_end, tokenizer.convert_tokens_to_ids(EOS)}
    # The warm start's greedy answers to the held-out problems, before any RL update: the same
    # weights in both engines, so the same tokens, ending at the same <|im_end|>.
    greedy = {engine: read_eval_answers(eval_answers_path(readme_runs[engine], 0))
              for engine in ("sampler", "vllm")}
    assert [(a.greedy, a.greedy_tokens, a.greedy_finished) for a in greedy["sampler"]] == [
        (a.greedy, a.greedy_tokens, a.greedy_finished) for a in greedy["vllm"]]
    assert all(a.greedy_finished for a in greedy["sampler"]), greedy
    # math-verify graded the response text (its stop token left out) against the row's answer:
    # the warm start's boxed answers are right, and every graded response agrees with
    # math-verify's own verdict.
    assert all(a.greedy_correct for a in greedy["sampler"]), greedy
    for answer in greedy["sampler"]:
        assert answer.greedy_correct == _math_verify(answer.answer, answer.greedy)
    # Sampled training responses: one that ended carries its stop token, in both engines.
    for engine in ("sampler", "vllm"):
        for record in read_rollouts(readme_runs[engine]):
            assert record["finished"] == (record["response_ids"][-1] in stops), record
            assert IM_END not in record["response"]
            assert record["reward"] == float(_math_verify(record["answer"], record["response"]))
        (step,) = [r for r in read_metrics(readme_runs[engine] / "metrics.jsonl")
                   if r["step"] == 1]
        assert 0.0 <= step["truncated_fraction"] <= 1.0 and step["response_length"] > 0


def test_rl_model_converts_to_a_hf_directory_with_tokenizer_generation_config_and_positions(
        readme_runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = readme_runs["runs/"] / "rl" / "hf"
    source = json.loads((readme_runs["hf"] / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    assert GenerationConfig.from_pretrained(out).eos_token_id == [im_end, tokenizer.eos_token_id]
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == MAX_POSITIONS  # not the run's seq_length
    assert config["eos_token_id"] == source["eos_token_id"]
    assert tokenizer.chat_template is not None
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    # The weights are the RL run's final policy (its full weights, saved at the end), not the
    # source model's.
    final = torch.load(readme_runs["sampler"] / "full_weights.pt")
    embedding = model.model.embed_tokens.weight
    assert torch.equal(embedding, final["embedding.word_embeddings.weight"][: len(embedding)])
    source_model = AutoModelForCausalLM.from_pretrained(readme_runs["hf"], local_files_only=True)
    assert not torch.equal(embedding, source_model.model.embed_tokens.weight)
