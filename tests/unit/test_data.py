"""Synthetic arithmetic data, its tokenizer and dataset directory, and layout-independent LM
batches."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from megatron_logra.data.dataset_dir import (
    SyntheticDataSpec,
    load_tokenizer,
    load_tokens,
    write_synthetic_dataset,
)
from megatron_logra.data.lm_batches import LMBatchSchedule
from megatron_logra.data.synthetic import generate_problems

PROBLEM_RE = re.compile(r"^(?:What is|Compute|Calculate) (\d+) (plus|minus) (\d+)[?.]$")
SMALL_SPEC = SyntheticDataSpec(num_train=2000, num_eval=200, seed=3)


def _canonical(problem) -> tuple[int, str, int]:
    match = PROBLEM_RE.match(problem.prompt)
    assert match is not None, problem.prompt
    return int(match.group(1)), match.group(2), int(match.group(3))


# --------------------------------------------------------------------------- problems


def test_generate_problems_is_deterministic():
    first = generate_problems(500, seed=5, split="train")
    assert first == generate_problems(500, seed=5, split="train")
    assert first != generate_problems(500, seed=6, split="train")


def test_shorter_request_is_a_prefix_of_longer_one():
    assert generate_problems(100, seed=5, split="eval") == generate_problems(
        300, seed=5, split="eval"
    )[:100]


def test_train_and_eval_problems_are_disjoint_across_seeds():
    # Disjointness is by the canonical problem (operands and operation), not the wording.
    train = {_canonical(p) for seed in (0, 1) for p in generate_problems(3000, seed=seed,
                                                                        split="train")}
    held_out = {_canonical(p) for seed in (0, 1) for p in generate_problems(1000, seed=seed,
                                                                           split="eval")}
    assert len(train) > 2000 and len(held_out) > 500
    assert train.isdisjoint(held_out)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_answers_are_arithmetically_correct_and_never_negative(split):
    for problem in generate_problems(3000, seed=2, split=split):
        a, op, b = _canonical(problem)
        assert int(problem.answer) == (a + b if op == "plus" else a - b)
        assert int(problem.answer) >= 0
        assert problem.answer == str(int(problem.answer))


def test_operands_respect_digit_bounds():
    for problem in generate_problems(2000, seed=4, split="train", min_digits=2, max_digits=4):
        a, _, b = _canonical(problem)
        assert 10 <= a <= 9999 and 10 <= b <= 9999


def test_operations_subset_yields_only_those_operations():
    ops = {_canonical(p)[1] for p in generate_problems(500, seed=1, split="train",
                                                        operations=("minus",))}
    assert ops == {"minus"}


def test_zero_pad_writes_fixed_width_operands_and_keeps_the_split_of_the_problem():
    padded = generate_problems(1000, seed=7, split="eval", max_digits=3, zero_pad=True)
    for problem in padded:
        operands = re.findall(r"\d+", problem.prompt)
        assert [len(x) for x in operands] == [3, 3], problem.prompt
        assert problem.answer == str(int(problem.answer))
    # The split is decided by the canonical problem, not its formatting: no padded held-out
    # problem is a training problem of any formatting.
    train = {_canonical(p) for pad in (False, True)
             for p in generate_problems(5000, seed=7, split="train", zero_pad=pad)}
    assert train.isdisjoint(_canonical(p) for p in padded)


def test_as_text_is_prompt_space_answer():
    problem = generate_problems(1, seed=0, split="train")[0]
    assert problem.as_text() == f"{problem.prompt} {problem.answer}"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [({"split": "test"}, "'test'"), ({"split": "train", "max_digits": 10}, "10"),
     ({"split": "train", "min_digits": 3, "max_digits": 2}, "3, 2"),
     ({"split": "train", "operations": ("plus", "times")}, "operations=['plus', 'times']"),
     ({"split": "train", "operations": ()}, "operations=[]")],
)
def test_bad_split_digit_range_or_operations_raises_value_error(kwargs, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        generate_problems(1, seed=0, **kwargs)


# --------------------------------------------------------------------------- dataset directory


@pytest.fixture(scope="module")
def dataset_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    return (write_synthetic_dataset(root / "a", SMALL_SPEC),
            write_synthetic_dataset(root / "b", SMALL_SPEC))


def test_dataset_directory_is_byte_identical_for_the_same_spec(dataset_dirs):
    first, second = dataset_dirs
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    assert names == ["corpus.txt", "eval.jsonl", "meta.json", "tokenizer.model", "tokens.npy",
                     "train.jsonl"]
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_dataset_directory_leaves_no_staging_directory(dataset_dirs):
    assert sorted(p.name for p in dataset_dirs[0].parent.iterdir()) == ["a", "b"]


def test_rewriting_a_dataset_directory_replaces_it(tmp_path):
    out = write_synthetic_dataset(tmp_path / "d", SyntheticDataSpec(num_train=50, num_eval=5))
    (out / "stale.txt").write_text("left over")
    write_synthetic_dataset(tmp_path / "d", SyntheticDataSpec(num_train=60, num_eval=5))
    assert not (out / "stale.txt").exists()
    assert len((out / "corpus.txt").read_text().splitlines()) == 60


def test_jsonl_files_hold_the_generated_problems(dataset_dirs):
    out = dataset_dirs[0]
    for name, split, count in (("train.jsonl", "train", SMALL_SPEC.num_train),
                               ("eval.jsonl", "eval", SMALL_SPEC.num_eval)):
        rows = [json.loads(line) for line in (out / name).read_text().splitlines()]
        expected = generate_problems(count, seed=SMALL_SPEC.seed, split=split)
        assert rows == [{"prompt": p.prompt, "answer": p.answer} for p in expected]


def test_tokenizer_round_trips_every_corpus_line(dataset_dirs):
    out = dataset_dirs[0]
    tokenizer = load_tokenizer(out)
    lines = (out / "corpus.txt").read_text().splitlines()
    assert len(lines) == SMALL_SPEC.num_train
    for line in lines:
        assert tokenizer.decode(tokenizer.encode(line)) == line


def test_tokenizer_splits_numbers_into_single_digits(dataset_dirs):
    tokenizer = load_tokenizer(dataset_dirs[0])
    for text in ("What is 347 plus 128? 475", "Compute 9999 minus 1000. 8999"):
        pieces = [tokenizer.decode([token]) for token in tokenizer.encode(text)]
        digit_pieces = [p for p in pieces if any(ch.isdigit() for ch in p)]
        assert all(len(p.strip()) == 1 for p in digit_pieces), pieces
        assert "".join(digit_pieces) == "".join(ch for ch in text if ch.isdigit())


def test_tokens_file_is_corpus_tokenized_with_eos_after_each_line(dataset_dirs):
    out = dataset_dirs[0]
    tokenizer = load_tokenizer(out)
    expected: list[int] = []
    for line in (out / "corpus.txt").read_text().splitlines():
        expected += tokenizer.encode(line) + [tokenizer.eos_id]
    tokens = load_tokens(out)
    assert tokens.dtype == np.int32
    assert tokens.tolist() == expected
    meta = json.loads((out / "meta.json").read_text())
    assert meta["num_tokens"] == len(expected)
    assert meta["vocab_size"] == tokenizer.vocab_size


def test_missing_tokens_or_tokenizer_raise_value_error_naming_the_path(tmp_path):
    with pytest.raises(ValueError, match="tokens.npy"):
        load_tokens(tmp_path)
    with pytest.raises(ValueError, match="tokenizer.model"):
        load_tokenizer(tmp_path)


# --------------------------------------------------------------------------- LM batches
#
# A token stream whose value is its position makes every sample checkable in closed form:
# sample i holds tokens i*L .. i*L + L (inputs) and i*L + 1 .. i*L + L + 1 (labels).

SEQ = 6
NUM_SAMPLES = 50
STREAM = np.arange(NUM_SAMPLES * SEQ + 1, dtype=np.int32)
GLOBAL_BATCH = 16


def _schedule(seed: int = 9) -> LMBatchSchedule:
    return LMBatchSchedule(STREAM, seq_length=SEQ, global_batch_size=GLOBAL_BATCH, seed=seed)


def _layout_tokens(schedule, step, dp_size, micro_batch_size) -> torch.Tensor:
    rows = []
    for dp_rank in range(dp_size):
        for mb in schedule.microbatches(step, dp_rank=dp_rank, dp_size=dp_size,
                                        micro_batch_size=micro_batch_size):
            assert mb.tokens.shape == (micro_batch_size, SEQ)
            rows.append(mb.tokens)
    return torch.cat(rows)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
@pytest.mark.parametrize("micro_batch_size", [1, 2, 4])
def test_union_of_microbatches_over_dp_ranks_is_the_global_batch_in_order(
    dp_size, micro_batch_size
):
    schedule = _schedule()
    for step in (0, 1, 5):  # step 5 reaches the second epoch (5 * 16 > 50 samples)
        indices = schedule.global_batch_indices(step)
        expected = torch.stack(
            [torch.arange(i * SEQ, i * SEQ + SEQ, dtype=torch.int64) for i in indices]
        )
        assert torch.equal(_layout_tokens(schedule, step, dp_size, micro_batch_size), expected)


def test_microbatch_labels_are_tokens_shifted_by_one():
    for mb in _schedule().microbatches(2, dp_rank=1, dp_size=2, micro_batch_size=4):
        assert torch.equal(mb.labels[:, :-1], mb.tokens[:, 1:])
        # the stream is its own position, so the next token is the input plus one.
        assert torch.equal(mb.labels, mb.tokens + 1)
        assert mb.tokens.dtype == mb.labels.dtype == torch.int64
        assert torch.equal(mb.loss_mask, torch.ones(4, SEQ))
        assert torch.equal(mb.position_ids, torch.arange(SEQ).expand(4, SEQ))


def test_each_epoch_is_a_permutation_of_all_samples():
    schedule = _schedule()
    steps = 2 * NUM_SAMPLES // GLOBAL_BATCH + 1
    flat = np.concatenate([schedule.global_batch_indices(s) for s in range(steps)])
    first, second = flat[:NUM_SAMPLES], flat[NUM_SAMPLES : 2 * NUM_SAMPLES]
    assert sorted(first.tolist()) == list(range(NUM_SAMPLES))
    assert sorted(second.tolist()) == list(range(NUM_SAMPLES))
    assert first.tolist() != second.tolist()


def test_epoch_wrap_is_deterministic_and_independent_of_query_order():
    forward = _schedule()
    in_order = [forward.global_batch_indices(s).tolist() for s in range(8)]
    backward = _schedule()
    reversed_order = [backward.global_batch_indices(s).tolist() for s in reversed(range(8))]
    assert in_order == reversed_order[::-1]
    assert in_order != [_schedule(seed=10).global_batch_indices(s).tolist() for s in range(8)]


def test_corpus_smaller_than_one_global_batch_raises_value_error():
    with pytest.raises(ValueError, match="global batch of 16"):
        LMBatchSchedule(STREAM[: 10 * SEQ + 1], seq_length=SEQ, global_batch_size=16, seed=0)


@pytest.mark.parametrize("dp_size, micro_batch_size", [(3, 1), (2, 3), (4, 8)])
def test_microbatches_reject_layouts_that_do_not_split_the_global_batch(dp_size, micro_batch_size):
    with pytest.raises(ValueError, match=f"dp={dp_size}"):
        _schedule().microbatches(0, dp_rank=0, dp_size=dp_size, micro_batch_size=micro_batch_size)
