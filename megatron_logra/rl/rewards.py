"""Rewards: score a batch of responses against reference answers, selected by name.

    reward = build_reward(RewardConfig(name="math_verify"))
    result = reward.score(responses, answers)    # RewardResult(rewards, correct, status, stats)
    reward.close()

Both rewards are 1.0 for a correct response and 0.0 otherwise; the advantage estimator decides
what an incorrect outcome is worth (the paper preset maps it to -0.01).

``exact_match`` (the synthetic arithmetic task). Extraction rule: skip leading whitespace; the
answer is the longest decimal literal ``[+-]?digits[.digits]`` that starts there. Whatever follows
it is ignored (text after EOS, a second problem the model went on to invent). A response that does
not start with a number has no answer. The answer is correct when it equals the reference
numerically (exact rational comparison, so ``475``, ``+475`` and ``0475`` all equal ``475``;
``475.5`` and ``4750`` do not). Each reference must itself be a number (``Fraction`` syntax:
``475``, ``-3``, ``0.5``, ``1/2``).

``math_verify`` (math answers). The math-verify library extracts the final answer from the
response (a ``\\boxed{...}`` answer first, several boxes being read together as one set; then
"final answer is ..."; then the last LaTeX or plain expression) and compares it with the parsed
reference symbolically. A reference answer is a bare expression in LaTeX or plain notation
(``42``, ``1/2``, ``\\frac{1}{2}``, ``2\\pi``) and is parsed as if boxed, so that its whole text is
one expression (unboxed, ``2\\pi`` would parse as ``2``); one that already starts with ``$`` or
contains ``\\boxed`` is parsed as given. math-verify's timeouts use ``signal.alarm``, which works
only in a process's main thread, and a pathological expression (e.g. a power tower) can hold the
GIL inside one big-integer operation that no alarm interrupts. So it runs in worker processes,
each grading in its own main thread, with a hard wall-clock deadline per batch in the parent:
workers still busy at the deadline are killed and replaced.

Grader failures are never silent. A response whose grading failed (math-verify's own timeout, the
batch deadline, a worker that died, an unexpected exception, a reference answer that cannot be
parsed) gets a ``status`` saying which, is counted in ``stats``, and is then handled by
``on_grader_failure``: ``zero_reward`` (logged as a warning, reward 0, correct False) or ``raise``
(RuntimeError).
"""

from __future__ import annotations

import logging
import multiprocessing
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

from megatron_logra.config import RewardConfig

logger = logging.getLogger(__name__)

# Per-response grading outcomes.
STATUS_GRADED = "graded"
"""An answer was extracted and compared; ``correct`` says how it compared."""
STATUS_NO_ANSWER = "no_answer"
"""No answer could be extracted from the response: an ordinary wrong response, not a failure."""
STATUS_GOLD_UNPARSED = "gold_unparsed"
"""The reference answer could not be parsed (a data problem)."""
STATUS_GRADER_TIMEOUT = "grader_timeout"
"""math-verify's own per-call timeout fired while parsing or comparing."""
STATUS_BATCH_TIMEOUT = "batch_timeout"
"""The batch deadline passed before this response was graded."""
STATUS_WORKER_CRASH = "worker_crash"
"""The worker process grading this response died."""
STATUS_GRADER_ERROR = "grader_error"
"""math-verify raised an unexpected exception."""

FAILURE_STATUSES: tuple[str, ...] = (
    STATUS_GOLD_UNPARSED,
    STATUS_GRADER_TIMEOUT,
    STATUS_BATCH_TIMEOUT,
    STATUS_WORKER_CRASH,
    STATUS_GRADER_ERROR,
)
ALL_STATUSES: tuple[str, ...] = (STATUS_GRADED, STATUS_NO_ANSWER, *FAILURE_STATUSES)

@dataclass(frozen=True)
class RewardResult:
    rewards: list[float]
    correct: list[bool]
    status: list[str]
    """One of ``ALL_STATUSES`` per response."""
    stats: dict[str, float] = field(default_factory=dict)
    """``num_responses``, ``num_correct``, ``accuracy``, ``num_failed`` and ``num_<status>``
    for every status."""


class Reward(Protocol):
    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult: ...

    def close(self) -> None: ...


def _check_batch(responses: Sequence[str], answers: Sequence[str]) -> None:
    if len(responses) != len(answers):
        raise ValueError(
            f"got {len(responses)} responses but {len(answers)} answers; pass one reference "
            "answer per response (repeat a prompt's answer for each of its samples)"
        )
    for name, texts in (("responses", responses), ("answers", answers)):
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(
                    f"{name}[{i}]={text!r} is a {type(text).__name__}; pass decoded text (str)"
                )


def _result(correct: list[bool], status: list[str], on_grader_failure: str) -> RewardResult:
    counts = {f"num_{name}": status.count(name) for name in ALL_STATUSES}
    num_failed = sum(counts[f"num_{name}"] for name in FAILURE_STATUSES)
    num_correct = sum(correct)
    stats: dict[str, float] = {
        "num_responses": len(status),
        "num_correct": num_correct,
        "accuracy": num_correct / len(status) if status else 0.0,
        "num_failed": num_failed,
        **counts,
    }
    if num_failed:
        failures = {
            name: counts[f"num_{name}"] for name in FAILURE_STATUSES if counts[f"num_{name}"]
        }
        if on_grader_failure == "raise":
            raise RuntimeError(
                f"grading failed for {num_failed} of {len(status)} responses {failures}; set "
                "on_grader_failure='zero_reward' to score them 0 instead"
            )
        logger.warning(
            "grading failed for %d of %d responses %s; policy on_grader_failure=zero_reward "
            "scores them 0", num_failed, len(status), failures,
        )
    rewards = [1.0 if ok else 0.0 for ok in correct]
    return RewardResult(rewards=rewards, correct=correct, status=status, stats=stats)


# ---------------------------------------------------------------------------------------------
# exact_match

# ASCII digits only: without re.ASCII, \d would also accept digits of other scripts.
_LEADING_NUMBER = re.compile(r"\s*([+-]?\d+(?:\.\d+)?)", re.ASCII)


def extract_leading_number(response: str) -> Fraction | None:
    """The exact_match extraction rule (module docstring); None when there is no answer."""
    match = _LEADING_NUMBER.match(response)
    return Fraction(match.group(1)) if match else None


class ExactMatchReward:
    """Numeric exact match of the response's leading number with the reference answer."""

    def __init__(self, config: RewardConfig) -> None:
        config.validate()
        self.config = config

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        _check_batch(responses, answers)
        references = []
        for i, answer in enumerate(answers):
            try:
                references.append(Fraction(answer.strip()))
            except (ValueError, ZeroDivisionError) as exc:
                raise ValueError(
                    f"answers[{i}]={answer!r} is not a number ({exc}); exact_match needs numeric "
                    "reference answers, use the math_verify reward for expressions"
                ) from exc
        correct: list[bool] = []
        status: list[str] = []
        for response, reference in zip(responses, references, strict=True):
            extracted = extract_leading_number(response)
            status.append(STATUS_NO_ANSWER if extracted is None else STATUS_GRADED)
            correct.append(extracted == reference)
        return _result(correct, status, self.config.on_grader_failure)

    def close(self) -> None:
        """Nothing to release."""


# ---------------------------------------------------------------------------------------------
# math_verify

# Messages from a worker to the parent (first element of the tuple).
_MSG_READY = "ready"
_MSG_STARTUP_FAILED = "startup_failed"
_MSG_RESULT = "result"
# Failed responses whose details are logged per batch (the counts cover all of them).
_MAX_LOGGED_FAILURES = 5


def reference_for_math_verify(answer: str) -> str:
    """The text math-verify parses for a reference answer (rule in the module docstring)."""
    stripped = answer.strip()
    if stripped.startswith("$") or "\\boxed" in stripped:
        return stripped
    return f"\\boxed{{{stripped}}}" if stripped else stripped


def _grade_one(
    response: str, answer: str, parsing_timeout_s: int, verify_timeout_s: int
) -> tuple[str, bool, str]:
    """(status, correct, detail) of one response; runs in a worker's main thread.

    ``raise_on_error=True`` makes math-verify raise its timeouts instead of logging them and
    returning "wrong", so they can be counted. Each (reference, prediction) candidate pair is
    compared on its own, as math-verify's list comparison does, so one failing pair does not
    hide a later matching one.
    """
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        gold = parse(reference_for_math_verify(answer), parsing_timeout=parsing_timeout_s,
                     raise_on_error=True)
    except TimeoutException:
        return STATUS_GRADER_TIMEOUT, False, "parsing the reference answer timed out"
    except Exception as exc:  # reported to the parent as a grader error
        return STATUS_GRADER_ERROR, False, f"parsing the reference raised {exc!r}"
    if not gold:
        return STATUS_GOLD_UNPARSED, False, f"reference answer {answer!r} has no parsable value"
    try:
        predicted = parse(response, parsing_timeout=parsing_timeout_s, raise_on_error=True)
    except TimeoutException:
        return STATUS_GRADER_TIMEOUT, False, "parsing the response timed out"
    except Exception as exc:  # reported to the parent as a grader error
        return STATUS_GRADER_ERROR, False, f"parsing the response raised {exc!r}"
    if not predicted:
        return STATUS_NO_ANSWER, False, ""
    failure: tuple[str, bool, str] | None = None
    for gold_candidate in gold:
        for predicted_candidate in predicted:
            try:
                if verify(
                    gold_candidate, predicted_candidate,
                    timeout_seconds=verify_timeout_s, raise_on_error=True,
                ):
                    return STATUS_GRADED, True, ""
            except TimeoutException:
                failure = (STATUS_GRADER_TIMEOUT, False, "comparison timed out")
            except Exception as exc:  # reported to the parent as a grader error
                failure = failure or (STATUS_GRADER_ERROR, False, f"comparison raised {exc!r}")
    return failure or (STATUS_GRADED, False, "")


def _math_verify_worker(conn: Connection, parsing_timeout_s: int, verify_timeout_s: int) -> None:
    """Worker process main loop: announce readiness, then grade (index, response, answer)
    requests until the parent closes the pipe (or kills the process)."""
    try:
        import math_verify  # noqa: F401  (imported here so start-up failures reach the parent)

        # The first parse imports math-verify's LaTeX grammar and sympy's printers lazily, which
        # takes seconds on a loaded machine: done here, it counts against startup_timeout_s
        # instead of firing the first response's parsing timeout.
        status, correct, detail = _grade_one("\\boxed{1}", "1", parsing_timeout_s=60,
                                             verify_timeout_s=60)
    except Exception as exc:  # sent to the parent, which raises RuntimeError
        conn.send((_MSG_STARTUP_FAILED, repr(exc)))
        return
    if not correct:
        conn.send((_MSG_STARTUP_FAILED, f"the warm-up grade of \\boxed{{1}} against 1 gave "
                                        f"status {status!r} {detail}"))
        return
    conn.send((_MSG_READY,))
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent is gone: nothing left to grade for
            return
        index, response, answer = request
        status, correct, detail = _grade_one(response, answer, parsing_timeout_s, verify_timeout_s)
        conn.send((_MSG_RESULT, index, status, correct, detail))


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    ready: bool = False
    item: int | None = None
    """Index of the response being graded, None when idle."""


class MathVerifyReward:
    """math-verify in a pool of worker processes with a hard deadline per batch.

    Workers start on the first ``score`` and are reused; a worker killed at the deadline or found
    dead is replaced (the replacement's start-up is waited for at the next ``score``). Call
    ``close`` (or use ``with``) to stop them.
    """

    def __init__(self, config: RewardConfig) -> None:
        config.validate()
        self.config = config
        self._context = multiprocessing.get_context(config.math_verify.start_method)
        self._workers: list[_Worker] = []
        self._closed = False

    def __enter__(self) -> MathVerifyReward:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def worker_pids(self) -> list[int | None]:
        """Process ids of the current workers (for operators and tests)."""
        return [worker.process.pid for worker in self._workers]

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        _check_batch(responses, answers)
        if self._closed:
            raise RuntimeError("MathVerifyReward.score called after close(); build a new reward")
        try:
            return self._score(responses, answers)
        except BaseException:
            # Workers may still hold items of the abandoned batch: the pool cannot be reused.
            self.close()
            raise

    def _score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        self._start_workers()
        outcomes: list[tuple[str, bool, str] | None] = [None] * len(responses)
        pending = deque(range(len(responses)))
        deadline = time.monotonic() + self.config.math_verify.batch_timeout_s
        while any(outcome is None for outcome in outcomes):
            for worker in self._workers:
                if worker.ready and worker.item is None and pending:
                    index = pending.popleft()
                    try:
                        worker.conn.send((index, responses[index], answers[index]))
                    except (BrokenPipeError, ConnectionResetError):
                        # The worker died since it last spoke: the item goes back to the queue
                        # and _service below replaces the worker.
                        pending.appendleft(index)
                        continue
                    worker.item = index
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            watched: list[Any] = [w.conn for w in self._workers]
            watched += [w.process.sentinel for w in self._workers]
            wait(watched, timeout=remaining)
            for slot in range(len(self._workers)):
                self._service(slot, outcomes)
        self._expire(outcomes, pending)

        status, correct, details = [], [], []
        for index, outcome in enumerate(outcomes):
            if outcome is None:
                raise RuntimeError(
                    f"math_verify response {index} has neither a grade nor a failure"
                )
            status.append(outcome[0])
            correct.append(outcome[1])
            details.append(outcome[2])
        failed = [i for i, name in enumerate(status) if name in FAILURE_STATUSES]
        for index in failed[:_MAX_LOGGED_FAILURES]:
            logger.warning("math_verify response %d: %s (%s)", index, status[index], details[index])
        return _result(correct, status, self.config.on_grader_failure)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self._closed = True
        for worker in self._workers:
            self._stop(worker)
        self._workers = []

    # -- worker management ------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_math_verify_worker,
            args=(child_conn, self.config.math_verify.parsing_timeout_s, self.config.math_verify.verify_timeout_s),
            name="math-verify-worker",
            daemon=True,  # never outlive the trainer, even if close() is not called
        )
        process.start()
        child_conn.close()
        return _Worker(process=process, conn=parent_conn)

    def _start_workers(self) -> None:
        """Make sure ``num_workers`` workers are alive and ready before the batch clock starts."""
        for slot, worker in enumerate(self._workers):
            if not worker.process.is_alive():
                self._stop(worker)
                self._workers[slot] = self._spawn()
        while len(self._workers) < self.config.math_verify.num_workers:
            self._workers.append(self._spawn())
        deadline = time.monotonic() + self.config.math_verify.startup_timeout_s
        while not all(worker.ready for worker in self._workers):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(
                    f"math-verify workers did not start within startup_timeout_s="
                    f"{self.config.math_verify.startup_timeout_s}; raise it on a slow or loaded machine"
                )
            starting = [w for w in self._workers if not w.ready]
            wait([w.conn for w in starting] + [w.process.sentinel for w in starting], remaining)
            for slot in range(len(self._workers)):
                self._service(slot, outcomes=None)

    def _service(self, slot: int, outcomes: list[tuple[str, bool, str] | None] | None) -> None:
        """Handle whatever worker ``slot`` has to say, or its death."""
        worker = self._workers[slot]
        try:
            has_message = worker.conn.poll()
            message = worker.conn.recv() if has_message else None
        except (EOFError, ConnectionResetError):
            message = None  # the worker closed its end: it is dying; handled below
        if message is not None:
            kind = message[0]
            if kind == _MSG_READY:
                worker.ready = True
            elif kind == _MSG_STARTUP_FAILED:
                raise RuntimeError(f"a math-verify worker failed to start: {message[1]}")
            elif kind == _MSG_RESULT:
                _, index, status, correct, detail = message
                if outcomes is None or index != worker.item:
                    raise RuntimeError(
                        f"math-verify worker sent a result for response {index} while assigned "
                        f"{worker.item}"
                    )
                outcomes[index] = (status, correct, detail)
                worker.item = None
            else:
                raise RuntimeError(f"math-verify worker sent an unknown message {message!r}")
            return
        if worker.process.is_alive() and not has_message:
            return
        # The worker died (its pipe reached end-of-file, or its process is gone).
        worker.process.join(timeout=1.0)
        exitcode = worker.process.exitcode
        if not worker.ready:
            raise RuntimeError(
                f"a math-verify worker (pid {worker.process.pid}) exited with code {exitcode} "
                "before it was ready"
            )
        if worker.item is not None:
            if outcomes is None:
                raise RuntimeError(
                    f"math-verify worker holds response {worker.item} outside score()"
                )
            outcomes[worker.item] = (
                STATUS_WORKER_CRASH, False, f"worker pid {worker.process.pid} exit code {exitcode}"
            )
        self._stop(worker)
        self._workers[slot] = self._spawn()

    def _expire(self, outcomes: list[tuple[str, bool, str] | None], pending: deque[int]) -> None:
        """At the deadline: kill and replace busy workers; mark what was not graded."""
        detail = f"not graded within batch_timeout_s={self.config.math_verify.batch_timeout_s}"
        for slot, worker in enumerate(self._workers):
            if worker.item is not None:
                outcomes[worker.item] = (STATUS_BATCH_TIMEOUT, False, detail)
                self._stop(worker)
                self._workers[slot] = self._spawn()
        for index in pending:
            outcomes[index] = (STATUS_BATCH_TIMEOUT, False, detail)
        pending.clear()

    @staticmethod
    def _stop(worker: _Worker) -> None:
        # A worker holds no state worth a graceful exit, and one stuck in a computation would
        # not read a shutdown request anyway: kill it.
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join()
        worker.conn.close()
        worker.process.close()


# One class per name of megatron_logra.config.REWARDS.
_REWARD_CLASSES: dict[str, Callable[[RewardConfig], Reward]] = {
    "exact_match": ExactMatchReward,
    "math_verify": MathVerifyReward,
}


def build_reward(config: RewardConfig) -> Reward:
    """The reward named by ``config.name``."""
    config.validate()
    return _REWARD_CLASSES[config.name](config)
