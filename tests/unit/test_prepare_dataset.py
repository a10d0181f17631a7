"""tools/prepare_dataset.py: GSM8K, MATH / DeepScaleR and verl files on local disk become problem
files the trainer reads, with answers math-verify can grade and solutions ending in \\boxed{}."""

from __future__ import annotations

import json

import pytest

from megatron_logra.config import DataConfig
from megatron_logra.data.problem_files import load_split
from tests.tools import load_tool

GSM8K_ROW = {"question": "Natalia sold 48 clips in April and half as many in May. How many?",
             "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn total 48+24 = "
                       "<<48+24=72>>72.\n#### 72"}


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _main():
    return load_tool("prepare_dataset").main


def test_gsm8k_answers_are_the_final_number_and_solutions_box_it(tmp_path):
    _jsonl(tmp_path / "gsm8k" / "grade_school_math" / "train.jsonl", [GSM8K_ROW])
    _jsonl(tmp_path / "gsm8k" / "grade_school_math" / "test.jsonl", [GSM8K_ROW, GSM8K_ROW])
    out = tmp_path / "out"
    assert _main()(["gsm8k", str(tmp_path / "gsm8k"), str(out)]) == 0
    train = load_split(DataConfig(dir=str(out), response_key="solution"), "train")
    assert len(load_split(DataConfig(dir=str(out)), "test")) == 2  # GSM8K's test.jsonl name
    assert train[0].prompt == GSM8K_ROW["question"] and train[0].answer == "72"
    assert train[0].target == ("In May she sold 48/2 = 24 clips.\nIn total 48+24 = 72.\n"
                               "The final answer is \\boxed{72}.")


def test_math_and_deepscaler_answers_come_from_the_last_box_or_the_answer_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = tmp_path / "math"
    source.mkdir()
    pq.write_table(pa.Table.from_pylist([
        {"problem": "Simplify $\\frac{4}{8}$.", "level": "Level 1",
         "solution": "Divide: $\\boxed{\\frac{1}{2}}$."}]), source / "test-00000-of-00001.parquet")
    # DeepScaleR ships one JSON list with an answer field and unboxed solutions.
    (source / "deepscaler.json").write_text(json.dumps([
        {"problem": "What is $2^{10}$?", "answer": "1024", "solution": "2^10 = 1024."}]))
    out = tmp_path / "out"
    assert _main()(["math", str(source), str(out)]) == 0
    test = load_split(DataConfig(dir=str(out), response_key="solution"), "test")
    train = load_split(DataConfig(dir=str(out), response_key="solution"), "train")
    assert (test[0].answer, test[0].target) == ("\\frac{1}{2}", "Divide: $\\boxed{\\frac{1}{2}}$.")
    assert (train[0].answer, train[0].target) == (
        "1024", "2^10 = 1024.\nThe final answer is \\boxed{1024}.")


def test_verl_parquet_keeps_the_messages_and_reads_the_nested_ground_truth(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = tmp_path / "verl"
    source.mkdir()
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "openai/gsm8k",
         "prompt": [{"role": "user", "content": "What is 2 plus 3? Output the answer after ####."}],
         "reward_model": {"style": "rule", "ground_truth": "5"}}]), source / "train.parquet")
    out = tmp_path / "out"
    assert _main()(["verl", str(source), str(out)]) == 0
    (problem,) = load_split(DataConfig(dir=str(out)), "train")
    assert (problem.prompt, problem.answer) == ("What is 2 plus 3? Output the answer after ####.",
                                                "5")


def test_a_bad_source_row_is_refused_naming_the_file_and_row(tmp_path, capsys):
    _jsonl(tmp_path / "in" / "train.jsonl", [GSM8K_ROW, {"question": "q", "answer": "no marker"}])
    assert _main()(["gsm8k", str(tmp_path / "in"), str(tmp_path / "out")]) == 2
    assert f"{tmp_path / 'in' / 'train.jsonl'}:2: answer 'no marker' has no '#### N' line" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("text", "boxed"), [("a \\boxed{x} b \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
                                             ("no box", None), ("\\fbox{3}", "3")])
def test_last_boxed_takes_the_last_box_with_balanced_braces(text, boxed):
    assert load_tool("prepare_dataset").last_boxed(text) == boxed
