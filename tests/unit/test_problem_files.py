"""Problem files: JSONL and Parquet rows, prompt strings and messages lists, dotted keys, split
file names; every error names the file, the row, the key and what was there."""

from __future__ import annotations

import json
import re

import pytest

from megatron_logra.config import DataConfig
from megatron_logra.data.problem_files import load_problems, split_file
from megatron_logra.data.prompt_data import PromptProblem

# verl's Parquet layout: the prompt is a messages list, the answer is nested in reward_model.
VERL_ROWS = [
    {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "What is 2 plus 3?"}],
     "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"index": 0}},
    {"data_source": "gsm8k", "prompt": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "What is 4 times 6?"}],
     "reward_model": {"style": "rule", "ground_truth": "24"}, "extra_info": {"index": 1}},
]
VERL_KEYS = DataConfig(answer_key="reward_model.ground_truth")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_parquet_and_jsonl_of_the_same_verl_rows_give_the_same_problems(tmp_path):
    from_parquet = load_problems(_parquet(tmp_path / "train.parquet", VERL_ROWS), VERL_KEYS)
    from_jsonl = load_problems(_jsonl(tmp_path / "train.jsonl", VERL_ROWS), VERL_KEYS)
    assert from_parquet == from_jsonl == [
        PromptProblem("What is 2 plus 3?", "5"),
        PromptProblem("What is 4 times 6?", "24", context=(("system", "Be brief."),)),
    ]
    assert from_parquet[1].origin == f"{tmp_path / 'train.parquet'} row 2"


def test_messages_rows_keep_their_context_and_a_trailing_assistant_turn_is_the_target(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                          {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
             "answer": 4},
            {"messages": [{"role": "user", "content": "3+3?"}], "answer": 6.5,
             "solution": "3+3 = \\boxed{6}"}]
    problems = load_problems(_jsonl(tmp_path / "chat.jsonl", rows),
                             DataConfig(prompt_key="messages"))
    assert problems[0] == PromptProblem("2+2?", "4", context=(("user", "Hi"), ("assistant", "Hello")),
                                        response="4")
    # A number as the answer is its text; without a trailing assistant turn the target is the
    # answer, or data.response_key's field when set.
    assert problems[1] == PromptProblem("3+3?", "6.5")
    assert problems[1].target == "6.5"
    rows[0]["solution"] = "4"
    with_solution = load_problems(_jsonl(tmp_path / "chat.jsonl", rows),
                                  DataConfig(prompt_key="messages", response_key="solution"))
    assert with_solution[1].target == "3+3 = \\boxed{6}"


@pytest.mark.parametrize(("row", "keys", "message"), [
    ({"question": "q", "answer": "1"}, {},
     "row 1: no data.prompt_key='prompt' (the row has keys ['answer', 'question']); set "
     "data.prompt_key"),
    ({"prompt": "q", "reward_model": {"style": "rule"}}, {"answer_key": "reward_model.ground_truth"},
     "row 1: no data.answer_key='reward_model.ground_truth' ('reward_model' holds ['style'])"),
    ({"prompt": "q", "answer": ["1", "2"]}, {},
     "row 1: data.answer_key='answer' is a list (['1', '2']), expected a string or a number"),
    ({"prompt": {"text": "q"}, "answer": "1"}, {},
     "row 1: data.prompt_key='prompt' is a dict ({'text': 'q'}), expected a string or a "
     "messages list"),
    ({"prompt": [{"role": "user", "text": "q"}], "answer": "1"}, {},
     "row 1: data.prompt_key='prompt' turn 0 is {'role': 'user', 'text': 'q'}"),
    ({"prompt": [{"role": "tool", "content": "q"}], "answer": "1"}, {},
     "row 1: data.prompt_key='prompt' turn 0 has role 'tool'; use one of ['system', 'user', "
     "'assistant']"),
    ({"prompt": [{"role": "system", "content": "s"}], "answer": "1"}, {},
     "row 1: data.prompt_key='prompt' must end with a user turn (optionally followed by the "
     "assistant's answer), got roles ['system']"),
])
def test_a_bad_row_names_the_file_row_key_and_what_was_found(tmp_path, row, keys, message):
    path = _parquet(tmp_path / "bad.parquet", [row])
    with pytest.raises(ValueError, match=re.escape(f"{path} {message}")):
        load_problems(path, DataConfig(**keys))


def test_a_bad_jsonl_line_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "q", "answer": "1"}) + "\n\n[1, 2]\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3 is a JSON list")):
        load_problems(path)


def test_split_files_are_found_by_their_usual_names_or_named_explicitly(tmp_path):
    _jsonl(tmp_path / "train.jsonl", [{"prompt": "q", "answer": "1"}])
    _jsonl(tmp_path / "test.jsonl", [{"prompt": "q", "answer": "1"}])
    data = DataConfig(dir=str(tmp_path))
    assert split_file(data, "train") == tmp_path / "train.jsonl"
    assert split_file(data, "test") == tmp_path / "test.jsonl"  # GSM8K's name
    with pytest.raises(ValueError, match=re.escape(
            "has no validation split (looked for valid.jsonl, validation.jsonl, valid.parquet, "
            "validation.parquet); name the file with data.validation_file=NAME "
            "(tools/prepare_dataset.py converts")):
        split_file(data, "validation")
    _jsonl(tmp_path / "eval.jsonl", [{"prompt": "q", "answer": "1"}])
    with pytest.raises(ValueError, match=re.escape(
            "holds ['eval.jsonl', 'test.jsonl'], more than one test split; choose one with "
            "data.test_file=NAME")):
        split_file(data, "test")
    explicit = DataConfig(dir=str(tmp_path), test_file="test.jsonl")
    assert split_file(explicit, "test") == tmp_path / "test.jsonl"
    with pytest.raises(ValueError, match=re.escape("data.train_file='nope.parquet': ")):
        split_file(DataConfig(dir=str(tmp_path), train_file="nope.parquet"), "train")
    with pytest.raises(ValueError, match="data.dir=.* does not exist"):
        split_file(DataConfig(dir=str(tmp_path / "absent")), "train")
