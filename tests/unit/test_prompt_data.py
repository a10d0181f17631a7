"""Supervised prompt -> answer batches: the loss covers exactly the answer and EOS tokens."""

from __future__ import annotations

import json

import pytest

from megatron_logra.data.dataset_dir import load_tokenizer
from megatron_logra.data.prompt_data import (
    PromptProblem,
    SupervisedBatchSchedule,
    load_problems,
    supervised_tokens,
)


def test_supervised_labels_under_the_mask_are_the_answer_then_eos(synthetic_data_dir):
    tokenizer = load_tokenizer(synthetic_data_dir)
    problems = load_problems(synthetic_data_dir / "train.jsonl")[:8]
    schedule = SupervisedBatchSchedule(problems, tokenizer, seq_length=32, global_batch_size=8,
                                       seed=0)
    (batch,) = schedule.microbatches(0, dp_rank=0, dp_size=1, micro_batch_size=8)
    indices = schedule.global_batch_indices(0)
    for row, index in enumerate(indices):
        problem = problems[int(index)]
        masked = batch.labels[row][batch.loss_mask[row] > 0].tolist()
        assert masked[-1] == tokenizer.eos_id
        assert tokenizer.decode(masked[:-1]).strip() == problem.answer
        # Everything before the answer is the prompt, and it carries no loss.
        prompt_len = len(tokenizer.encode(problem.prompt))
        assert batch.tokens[row, :prompt_len].tolist() == tokenizer.encode(problem.prompt)
        assert float(batch.loss_mask[row, : prompt_len - 1].sum()) == 0.0


def test_supervised_batches_are_the_same_global_batch_for_any_dp_split(synthetic_data_dir):
    tokenizer = load_tokenizer(synthetic_data_dir)
    problems = load_problems(synthetic_data_dir / "train.jsonl")[:64]
    schedule = SupervisedBatchSchedule(problems, tokenizer, seq_length=32, global_batch_size=8,
                                       seed=3)
    whole = schedule.microbatches(5, dp_rank=0, dp_size=1, micro_batch_size=8)[0].tokens
    split = [mb.tokens for d in range(2)
             for mb in schedule.microbatches(5, dp_rank=d, dp_size=2, micro_batch_size=2)]
    import torch

    assert torch.equal(torch.cat(split), whole)


def test_problem_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1 needs string fields"):
        load_problems(bad)


def test_too_long_sample_is_refused_with_the_fix(synthetic_data_dir):
    tokenizer = load_tokenizer(synthetic_data_dir)
    long_problem = PromptProblem("What is " + "1" * 40 + " plus 1?", "2")
    ids, _ = supervised_tokens(long_problem, tokenizer)
    with pytest.raises(ValueError, match="raise model.seq_length"):
        SupervisedBatchSchedule([long_problem], tokenizer, seq_length=len(ids) - 2,
                                global_batch_size=1, seed=0)
