"""Per-problem evaluation answers: file round trip and the paired (McNemar) comparison."""

from __future__ import annotations

import math

import pytest

from megatron_logra.rl.eval_answers import (
    EvalAnswer,
    eval_answers_path,
    paired_greedy_change,
    read_eval_answers,
    write_eval_answers,
)


def _answers(correct: list[bool]) -> list[EvalAnswer]:
    return [EvalAnswer(prompt=f"What is {i} plus 1?", answer=str(i + 1), greedy="?",
                       greedy_correct=c, samples_correct=int(c)) for i, c in enumerate(correct)]


def test_eval_answers_round_trip_through_the_step_file(tmp_path):
    answers = _answers([True, False, True])
    path = eval_answers_path(tmp_path, 25)
    write_eval_answers(answers, path)
    assert path.name == "step_000025.jsonl"
    assert read_eval_answers(path) == answers
    assert not list(path.parent.glob(".*.tmp"))


def test_paired_change_counts_flips_and_uses_the_mcnemar_standard_error():
    before = _answers([True, True, False, False, False, True, False, False])
    after = _answers([True, False, True, True, True, True, False, False])
    change = paired_greedy_change(before, after)
    # Flipped: problem 1 lost; problems 2, 3, 4 gained.
    assert (change.gained, change.lost, change.problems) == (3, 1, 8)
    assert change.before == 3 / 8 and change.after == 5 / 8
    assert change.standard_error == math.sqrt(4) / 8
    assert change.z == (2 / 8) / (2 / 8)


def test_paired_change_without_flips_has_zero_z():
    same = _answers([True, False])
    assert paired_greedy_change(same, same).z == 0.0


def test_paired_change_refuses_evaluations_of_different_problems():
    with pytest.raises(ValueError, match="same problems"):
        paired_greedy_change(_answers([True, False]), _answers([True]))
