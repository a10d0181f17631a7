"""The prompt builder: the tokenizer's own chat template (system prompt, user template, template
kwargs, generation prompt), supervised targets as the template's assistant turn with the prompt
masked and nothing invented between them, and the stop tokens as a set."""

from __future__ import annotations

import json
import re

import pytest

from megatron_logra.config import PromptConfig
from megatron_logra.data.hf_tokenizer import GENERATION_CONFIG_FILE, HFTokenizer
from megatron_logra.data.prompt_builder import PromptBuilder
from megatron_logra.data.prompt_data import PromptProblem, SupervisedBatchSchedule
from tests.chat_tokenizer import EOS, IM_END, save_chat_tokenizer

SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
TEMPLATE = "{prompt}\nAnswer with a number."
PROBLEM = PromptProblem("What is 12 plus 7?", "19", response="12 plus 7 is \\boxed{19}.")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    directory = save_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))
    # The model's generation config, as tools/convert_hf.py copies it beside the tokenizer.
    hf = _hf(directory)
    (directory / GENERATION_CONFIG_FILE).write_text(json.dumps(
        {"eos_token_id": [hf.convert_tokens_to_ids(IM_END), hf.convert_tokens_to_ids(EOS)]}))
    return directory


def _hf(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _transformers_ids(directory, messages, **kwargs) -> list[int]:
    return list(_hf(directory).apply_chat_template(messages, tokenize=True,
                                                   add_generation_prompt=True,
                                                   **kwargs)["input_ids"])


def test_prompt_ids_are_transformers_chat_template_ids_with_system_prompt_and_user_template(
        chat_dir):
    builder = PromptBuilder(HFTokenizer(chat_dir), PromptConfig(
        chat_template=True, system_prompt=SYSTEM, user_template=TEMPLATE))
    expected = _transformers_ids(chat_dir, [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 12 plus 7?\nAnswer with a number."}])
    assert builder.prompt_ids(PROBLEM) == expected
    assert builder.prompt_text(PROBLEM).endswith("<|im_start|>assistant\n")


def test_template_kwargs_reach_the_template(chat_dir):
    builder = PromptBuilder(HFTokenizer(chat_dir), PromptConfig(
        chat_template=True, template_kwargs={"enable_thinking": False}))
    messages = [{"role": "user", "content": PROBLEM.prompt}]
    assert builder.prompt_ids(PROBLEM) == _transformers_ids(chat_dir, messages,
                                                            enable_thinking=False)
    assert builder.prompt_ids(PROBLEM) != _transformers_ids(chat_dir, messages)
    assert builder.prompt_text(PROBLEM).endswith("<think>\n\n</think>\n\n")


def test_messages_context_is_rendered_before_the_prompt(chat_dir):
    problem = PromptProblem("And 2+3?", "5", context=(("system", "Be brief."), ("user", "2+2?"),
                                                      ("assistant", "4")))
    builder = PromptBuilder(HFTokenizer(chat_dir), PromptConfig(chat_template=True))
    assert builder.prompt_ids(problem) == _transformers_ids(chat_dir, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 2+3?"}])


@pytest.mark.parametrize(("kwargs", "head"), [({}, "<think>\n\n</think>\n\n"),
                                              ({"enable_thinking": False}, "")])
def test_sft_target_is_the_templates_assistant_turn_to_its_end_of_turn_with_the_prompt_masked(
        chat_dir, kwargs, head):
    tokenizer = HFTokenizer(chat_dir)
    builder = PromptBuilder(tokenizer, PromptConfig(chat_template=True, system_prompt=SYSTEM,
                                                    template_kwargs=kwargs))
    ids, prompt_len = builder.supervised_tokens(PROBLEM)
    # The prompt part is exactly what rollouts are given.
    assert ids[:prompt_len] == builder.prompt_ids(PROBLEM)
    # The target is the assistant turn the template writes after its generation prompt (Qwen3's
    # empty think block unless the generation prompt already holds it), the response text with
    # no separator invented before it, and the end-of-turn token; not the newline after it.
    hf = _hf(chat_dir)
    assert hf.decode(ids[prompt_len:]) == head + PROBLEM.response + IM_END
    assert ids[-1] == hf.convert_tokens_to_ids(IM_END)
    whole = hf.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROBLEM.prompt},
         {"role": "assistant", "content": PROBLEM.response}], tokenize=False, **kwargs)
    assert whole == hf.decode(ids) + "\n"
    # The loss covers the target tokens and the stop token, nothing of the prompt.
    schedule = SupervisedBatchSchedule([PROBLEM], builder, seq_length=len(ids) + 3,
                                       global_batch_size=1, seed=0)
    (batch,) = schedule.microbatches(0, dp_rank=0, dp_size=1, micro_batch_size=1)
    assert batch.labels[0][batch.loss_mask[0] > 0].tolist() == ids[prompt_len:]


def test_plain_text_prompts_use_the_user_template_and_add_no_separator(chat_dir):
    tokenizer = HFTokenizer(chat_dir)
    builder = PromptBuilder(tokenizer, PromptConfig(user_template="Q: {prompt}\nA: "))
    problem = PromptProblem("What is 12 plus 7?", "19")
    assert builder.prompt_ids(problem) == tokenizer.encode("Q: What is 12 plus 7?\nA: ")
    ids, prompt_len = builder.supervised_tokens(problem)
    assert ids[prompt_len:] == [*tokenizer.encode("19"), tokenizer.eos_id]


def test_stop_tokens_are_eos_generation_config_and_the_templates_end_of_turn(chat_dir):
    hf = _hf(chat_dir)
    eos, im_end = hf.convert_tokens_to_ids(EOS), hf.convert_tokens_to_ids(IM_END)
    tokenizer = HFTokenizer(chat_dir)
    assert tokenizer.eos_id == eos  # the base model's EOS is not the end of a chat turn
    with_template = PromptBuilder(tokenizer, PromptConfig(chat_template=True))
    assert with_template.end_of_turn == im_end
    assert set(with_template.stop_ids) == {eos, im_end}
    (chat_dir / GENERATION_CONFIG_FILE).rename(chat_dir / "moved.json")
    try:
        plain = PromptBuilder(HFTokenizer(chat_dir), PromptConfig())
        templated = PromptBuilder(HFTokenizer(chat_dir), PromptConfig(chat_template=True))
    finally:
        (chat_dir / "moved.json").rename(chat_dir / GENERATION_CONFIG_FILE)
    assert plain.stop_ids == (eos,) and plain.target_end == eos
    assert set(templated.stop_ids) == {eos, im_end} and templated.target_end == im_end
    # A response's text for the reward leaves out its stop token, whichever it is.
    body = tokenizer.encode("\\boxed{19}")
    assert with_template.response_text([*body, im_end]) == "\\boxed{19}"
    assert with_template.finished([*body, eos]) and not with_template.finished(body)


def test_prompts_that_cannot_be_built_are_refused_naming_the_row(chat_dir, tmp_path):
    tokenizer = HFTokenizer(chat_dir)
    row = PromptProblem("q", "1", context=(("system", "s"),), origin="t.jsonl:3")
    with pytest.raises(ValueError, match=re.escape(
            "t.jsonl:3: a messages prompt with 1 turn(s) before the user's needs "
            "data.prompt.chat_template=true")):
        PromptBuilder(tokenizer, PromptConfig()).prompt_ids(row)
    with pytest.raises(ValueError, match=re.escape(
            "t.jsonl:3: the row has its own system turn and data.prompt.system_prompt is set")):
        PromptBuilder(tokenizer, PromptConfig(chat_template=True, system_prompt="x")).prompt_ids(row)
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(chat_dir), local_files_only=True)
    plain.chat_template = None
    plain.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="data.prompt.chat_template=true but the tokenizer .* has "
                                         "no chat template"):
        PromptBuilder(HFTokenizer(tmp_path), PromptConfig(chat_template=True))
