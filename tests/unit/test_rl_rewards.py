"""Rewards on real answer formats: the synthetic arithmetic task and math-verify's formats, plus
every grader-failure path of the math-verify worker pool (its own timeout, the batch deadline, a
worker killed mid-grading, an unparsable reference) being counted and reported.

The slow inputs are real pathological answers, not mocks: ``7^{7^{9}}`` makes sympy build a
34-million-digit integer (seconds of work that math-verify's alarm can interrupt), and
``9^{9^{9^{9}}}`` never finishes at all.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from megatron_logra.config import REWARDS, MathVerifyConfig
from megatron_logra.data.synthetic import generate_problems
from megatron_logra.rl.rewards import (
    STATUS_BATCH_TIMEOUT,
    STATUS_GOLD_UNPARSED,
    STATUS_GRADED,
    STATUS_GRADER_TIMEOUT,
    STATUS_NO_ANSWER,
    STATUS_WORKER_CRASH,
    ExactMatchReward,
    MathVerifyReward,
    RewardConfig,
    build_reward,
)

SLOW_ANSWER = r"\boxed{7^{7^{9}}}"
NEVER_ENDING_ANSWER = r"\boxed{9^{9^{9^{9}}}}"
# The batch deadline used where a test needs it to fire: short, so the test is quick; the
# never-ending answer cannot finish within any deadline, so the outcome does not depend on it.
SHORT_BATCH_TIMEOUT_S = 0.5
# Inner (math-verify) timeouts long enough that only the batch deadline can stop the grading.
LONG_INNER_TIMEOUT_S = 60
# When the test kills the busy worker: after dispatch (immediate once workers are ready), long
# before the never-ending answer could be graded.
KILL_AFTER_S = 0.3
# Upper bound on a batch whose deadline fired: the deadline plus killing and reaping one worker
# (milliseconds) on a loaded 2-core machine.
DEADLINE_SLACK_S = 5.0


def _config(**settings) -> RewardConfig:
    """A RewardConfig from flat settings: the grader pool's go to its math_verify section."""
    pool = {k: settings.pop(k) for k in list(settings)
            if k in MathVerifyConfig.__dataclass_fields__}
    return RewardConfig(**settings, math_verify=MathVerifyConfig(**pool))


@pytest.fixture(scope="module")
def math_verify_reward():
    reward = MathVerifyReward(_config(name="math_verify", num_workers=2))
    yield reward
    reward.close()


# --- exact_match -------------------------------------------------------------------------------


def test_exact_match_scores_synthetic_task_responses():
    problems = generate_problems(3, seed=0, split="train")
    answers = [p.answer for p in problems]
    wrong = str(int(answers[2]) + 1)
    responses = [
        f" {answers[0]}",
        # EOS not generated: the model went on to invent another problem; only the leading
        # number counts.
        f" {answers[1]} What is 1 plus 2? 3",
        f" {wrong}",
    ]
    result = ExactMatchReward(RewardConfig()).score(responses, answers)
    assert result.correct == [True, True, False]
    assert result.rewards == [1.0, 1.0, 0.0]
    assert result.status == [STATUS_GRADED] * 3
    assert result.stats["num_correct"] == 2
    assert result.stats["accuracy"] == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    ("response", "correct", "status"),
    [
        ("475", True, STATUS_GRADED),
        ("  475\n", True, STATUS_GRADED),
        (" +475", True, STATUS_GRADED),
        (" 0475", True, STATUS_GRADED),  # numerically equal
        (" 475.0", True, STATUS_GRADED),
        (" 475.", True, STATUS_GRADED),  # the period ends the sentence, not the number
        (" 475abc", True, STATUS_GRADED),  # decoded garbage glued after the number
        (" 4750", False, STATUS_GRADED),  # the whole digit run is the answer
        (" 475.5", False, STATUS_GRADED),
        (" -475", False, STATUS_GRADED),
        (" 47 5", False, STATUS_GRADED),
        (" The answer is 475", False, STATUS_NO_ANSWER),  # must start with the number
        ("", False, STATUS_NO_ANSWER),
    ],
)
def test_exact_match_extraction_rule(response, correct, status):
    result = ExactMatchReward(RewardConfig()).score([response], ["475"])
    assert result.correct == [correct]
    assert result.status == [status]


def test_exact_match_rejects_a_non_numeric_reference_naming_it():
    with pytest.raises(ValueError, match=r"answers\[1\]='x\+1'"):
        ExactMatchReward(RewardConfig()).score([" 1", " 2"], ["1", "x+1"])


def test_rewards_reject_batches_of_different_lengths():
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        ExactMatchReward(RewardConfig()).score([" 1", " 2"], ["1"])


def test_rewards_reject_non_text_responses_naming_them():
    with pytest.raises(ValueError, match=r"responses\[1\]=None"):
        ExactMatchReward(RewardConfig()).score([" 1", None], ["1", "2"])


def test_registry_builds_each_reward_by_name():
    assert REWARDS == ("exact_match", "math_verify")
    assert isinstance(build_reward(RewardConfig(name="exact_match")), ExactMatchReward)
    reward = build_reward(RewardConfig(name="math_verify"))
    try:
        assert isinstance(reward, MathVerifyReward)
    finally:
        reward.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [("name", "regex"), ("on_grader_failure", "ignore"), ("start_method", "fork"),
     ("num_workers", 0), ("batch_timeout_s", 0.0), ("parsing_timeout_s", 0)],
)
def test_reward_config_rejects_invalid_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        _config(**{field: value}).validate()


# --- math_verify: answer formats ---------------------------------------------------------------

MATH_CASES = [
    # (response, reference, correct, status)
    (r"The probability is \boxed{1/2}.", "1/2", True, STATUS_GRADED),
    ("The final answer is 42", "42", True, STATUS_GRADED),
    (r"So the ratio is $\frac{3}{4}$.", "0.75", True, STATUS_GRADED),
    (r"We get \boxed{\dfrac{1}{2}}", r"\frac{1}{2}", True, STATUS_GRADED),
    (r"First 41, then \boxed{42}", "42", True, STATUS_GRADED),  # the boxed answer wins
    (r"$\frac{2}{4}$", r"$\frac{1}{2}$", True, STATUS_GRADED),
    (r"The final answer is $(x+1)^2$", r"x^2+2x+1", True, STATUS_GRADED),
    (r"The circumference is $2\pi$.", r"2\pi", True, STATUS_GRADED),  # whole reference parsed
    (r"The circumference is $2$.", r"2\pi", False, STATUS_GRADED),
    (" 475", "475", True, STATUS_GRADED),  # the synthetic format
    (r"\boxed{41}", "42", False, STATUS_GRADED),  # wrong
    (r"The final answer is $\frac{1}{3}$", r"\frac{1}{2}", False, STATUS_GRADED),  # wrong
    (r"\frac{1}{", r"\frac{1}{2}", False, STATUS_NO_ANSWER),  # malformed: nothing to extract
    (r"}}}{{{\\\&%$$$", r"\frac{1}{2}", False, STATUS_NO_ANSWER),  # malformed
    (r"$\sqrt{$", r"\frac{1}{2}", False, STATUS_GRADED),  # malformed: a string that matches nothing
    ("", "42", False, STATUS_NO_ANSWER),
]


def test_math_verify_grades_real_answer_formats(math_verify_reward):
    responses = [case[0] for case in MATH_CASES]
    answers = [case[1] for case in MATH_CASES]
    result = math_verify_reward.score(responses, answers)
    assert result.correct == [case[2] for case in MATH_CASES]
    assert result.status == [case[3] for case in MATH_CASES]
    assert result.rewards == [1.0 if case[2] else 0.0 for case in MATH_CASES]
    assert result.stats["num_correct"] == sum(case[2] for case in MATH_CASES)
    assert result.stats["num_no_answer"] == 3
    assert result.stats["num_failed"] == 0


def test_math_verify_unparsable_reference_is_counted_and_scored_zero_by_logged_policy(
    math_verify_reward, caplog
):
    with caplog.at_level(logging.WARNING, logger="megatron_logra.rl.rewards"):
        result = math_verify_reward.score([r"\boxed{2}", r"\boxed{2}"], ["2", ""])
    assert result.status == [STATUS_GRADED, STATUS_GOLD_UNPARSED]
    assert result.rewards == [1.0, 0.0]
    assert result.stats["num_gold_unparsed"] == 1
    assert result.stats["num_failed"] == 1
    assert "on_grader_failure=zero_reward" in caplog.text


def test_math_verify_raise_policy_raises_on_grader_failure():
    with MathVerifyReward(
        _config(name="math_verify", num_workers=1, on_grader_failure="raise")
    ) as reward:
        with pytest.raises(RuntimeError, match="grading failed for 1 of 1 responses"):
            reward.score([r"\boxed{2}"], [""])


# --- math_verify: timeouts and crashes ---------------------------------------------------------


def test_math_verify_own_timeout_is_counted_as_grader_timeout():
    config = _config(name="math_verify", num_workers=1, parsing_timeout_s=1, verify_timeout_s=1
    )
    with MathVerifyReward(config) as reward:
        result = reward.score([SLOW_ANSWER, r"\boxed{2}"], ["1", "2"])
    assert result.status == [STATUS_GRADER_TIMEOUT, STATUS_GRADED]
    assert result.correct == [False, True]
    assert result.stats["num_grader_timeout"] == 1
    assert result.stats["num_failed"] == 1


def test_batch_deadline_kills_a_hung_worker_and_counts_batch_timeouts():
    config = _config(name="math_verify", num_workers=1, batch_timeout_s=SHORT_BATCH_TIMEOUT_S,
        parsing_timeout_s=LONG_INNER_TIMEOUT_S, verify_timeout_s=LONG_INNER_TIMEOUT_S,
    )
    with MathVerifyReward(config) as reward:
        reward.score(["1"], ["1"])  # start the worker outside the timed batch
        [hung_pid] = reward.worker_pids()
        start = time.monotonic()
        # One worker: the first response hangs it, the second is still queued at the deadline.
        result = reward.score([NEVER_ENDING_ANSWER, r"\boxed{2}"], ["1", "2"])
        elapsed = time.monotonic() - start
        assert result.status == [STATUS_BATCH_TIMEOUT, STATUS_BATCH_TIMEOUT]
        assert result.rewards == [0.0, 0.0]
        assert result.stats["num_batch_timeout"] == 2
        assert SHORT_BATCH_TIMEOUT_S <= elapsed < SHORT_BATCH_TIMEOUT_S + DEADLINE_SLACK_S
        assert reward.worker_pids() != [hung_pid]  # killed and replaced
        # The replacement grades the next batch normally.
        assert reward.score([r"\boxed{2}"], ["2"]).correct == [True]


def test_worker_killed_mid_grading_is_counted_as_crash_and_replaced():
    config = _config(name="math_verify", num_workers=1,
        parsing_timeout_s=LONG_INNER_TIMEOUT_S, verify_timeout_s=LONG_INNER_TIMEOUT_S,
    )
    with MathVerifyReward(config) as reward:
        reward.score(["1"], ["1"])
        [pid] = reward.worker_pids()
        killer = threading.Timer(KILL_AFTER_S, os.kill, (pid, signal.SIGKILL))
        killer.start()
        try:
            result = reward.score([NEVER_ENDING_ANSWER, r"\boxed{2}"], ["1", "2"])
        finally:
            killer.join()
        assert result.status == [STATUS_WORKER_CRASH, STATUS_GRADED]
        assert result.correct == [False, True]
        assert result.stats["num_worker_crash"] == 1
        assert result.stats["num_failed"] == 1
        assert reward.worker_pids() != [pid]


def test_score_after_close_raises():
    reward = MathVerifyReward(_config(name="math_verify", num_workers=1))
    reward.close()
    with pytest.raises(RuntimeError, match="after close"):
        reward.score(["1"], ["1"])
