"""Supervised prompt -> answer batches: the loss covers exactly the target and its stop token, and
the prompt part is the prompt ids rollouts see."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.config import PromptConfig
from megatron_logra.data.dataset_dir import load_tokenizer
from megatron_logra.data.problem_files import load_problems
from megatron_logra.data.prompt_builder import PromptBuilder
from megatron_logra.data.prompt_data import PromptProblem, SupervisedBatchSchedule


def _builder(data_dir) -> PromptBuilder:
    return PromptBuilder(load_tokenizer(data_dir), PromptConfig())


def test_supervised_labels_under_the_mask_are_the_answer_then_eos(synthetic_data_dir):
    builder = _builder(synthetic_data_dir)
    tokenizer = builder.tokenizer
    problems = load_problems(synthetic_data_dir / "train.jsonl")[:8]
    schedule = SupervisedBatchSchedule(problems, builder, seq_length=32, global_batch_size=8,
                                       seed=0)
    (batch,) = schedule.microbatches(0, dp_rank=0, dp_size=1, micro_batch_size=8)
    indices = schedule.global_batch_indices(0)
    for row, index in enumerate(indices):
        problem = problems[int(index)]
        masked = batch.labels[row][batch.loss_mask[row] > 0].tolist()
        assert masked[-1] == tokenizer.eos_id
        assert tokenizer.decode(masked[:-1]).strip() == problem.answer
        # Everything before the answer is the prompt rollouts see, and it carries no loss.
        prompt_ids = builder.prompt_ids(problem)
        assert batch.tokens[row, : len(prompt_ids)].tolist() == prompt_ids
        assert float(batch.loss_mask[row, : len(prompt_ids) - 1].sum()) == 0.0


def test_synthetic_task_samples_equal_the_tokenized_prompt_space_answer_line(synthetic_data_dir):
    # The target is tokenized on its own after the prompt; on the synthetic task's SentencePiece
    # model that is exactly the tokenization of the corpus line "prompt answer" (so the demo's
    # warm start trains on the same tokens as before targets were built this way).
    builder = _builder(synthetic_data_dir)
    for problem in load_problems(synthetic_data_dir / "train.jsonl")[:500]:
        ids, _ = builder.supervised_tokens(problem)
        joined = builder.tokenizer.encode(f"{problem.prompt} {problem.answer}")
        assert ids == [*joined, builder.tokenizer.eos_id], problem


def test_supervised_batches_are_the_same_global_batch_for_any_dp_split(synthetic_data_dir):
    builder = _builder(synthetic_data_dir)
    problems = load_problems(synthetic_data_dir / "train.jsonl")[:64]
    schedule = SupervisedBatchSchedule(problems, builder, seq_length=32, global_batch_size=8,
                                       seed=3)
    whole = schedule.microbatches(5, dp_rank=0, dp_size=1, micro_batch_size=8)[0].tokens
    split = [mb.tokens for d in range(2)
             for mb in schedule.microbatches(5, dp_rank=d, dp_size=2, micro_batch_size=2)]
    assert torch.equal(torch.cat(split), whole)


def test_too_long_sample_is_refused_naming_its_row_and_the_fix(synthetic_data_dir):
    builder = _builder(synthetic_data_dir)
    long_problem = PromptProblem("What is " + "1" * 40 + " plus 1?", "2", origin="x.jsonl:7")
    ids, _ = builder.supervised_tokens(long_problem)
    with pytest.raises(ValueError, match=r"x.jsonl:7 takes \d+ tokens .*raise model.seq_length"):
        SupervisedBatchSchedule([long_problem], builder, seq_length=len(ids) - 2,
                                global_batch_size=1, seed=0)
