"""Per-problem results of one held-out evaluation, kept next to the aggregate metrics.

``rl`` writes ``<run.dir>/eval/step_NNNNNN.jsonl`` at every evaluation: one line per problem with
the prompt, the reference answer, the greedy response (its text, token count and whether it ended
with a stop token) and whether it was right, and how many of the k sampled responses were right. Two evaluations of one run cover the same problems in the same
order, so they can be compared problem by problem (:func:`paired_greedy_change`): a paired
comparison removes the problem-difficulty variance that an unpaired before/after comparison of
two accuracies carries.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_logra.atomic_write import write_atomically

EVAL_DIR = "eval"


@dataclass(frozen=True)
class EvalAnswer:
    prompt: str
    answer: str
    greedy: str
    greedy_correct: bool
    samples_correct: int
    """How many of the evaluation's k samples were right."""
    greedy_tokens: int = 0
    """Tokens of the greedy response, its stop token included."""
    greedy_finished: bool = False
    """The greedy response ended with a stop token (False: cut at rl.sampling.max_new_tokens)."""


def eval_answers_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / EVAL_DIR / f"step_{step:06d}.jsonl"


def write_eval_answers(answers: list[EvalAnswer], path: Path) -> None:
    """All lines at once, renamed into place: a reader never sees half an evaluation."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, "".join(json.dumps(asdict(a)) + "\n" for a in answers))


def read_eval_answers(path: Path) -> list[EvalAnswer]:
    return [EvalAnswer(**json.loads(line)) for line in Path(path).read_text().splitlines()]


@dataclass(frozen=True)
class PairedChange:
    """Greedy accuracy before -> after on the same problems, with the paired standard error."""

    problems: int
    before: float
    after: float
    gained: int
    """Problems wrong before and right after."""
    lost: int
    """Problems right before and wrong after."""

    @property
    def change(self) -> float:
        return self.after - self.before

    @property
    def standard_error(self) -> float:
        """Standard error of the change under the null of no change (McNemar's test): only the
        problems whose outcome flipped carry information, sqrt(gained + lost) / problems."""
        return math.sqrt(self.gained + self.lost) / self.problems

    @property
    def z(self) -> float:
        return self.change / self.standard_error if self.gained + self.lost else 0.0


def paired_greedy_change(before: list[EvalAnswer], after: list[EvalAnswer]) -> PairedChange:
    """Compare two evaluations of the same problems; raises if they are not the same problems."""
    if [(a.prompt, a.answer) for a in before] != [(a.prompt, a.answer) for a in after]:
        raise ValueError(
            "the two evaluations do not cover the same problems in the same order; compare "
            "evaluations of one run (same data.dir and rl.eval_prompts)"
        )
    if not before:
        raise ValueError("the evaluations are empty; rl.eval_prompts must be at least 1")
    gained = sum(not b.greedy_correct and a.greedy_correct for b, a in zip(before, after, strict=True))
    lost = sum(b.greedy_correct and not a.greedy_correct for b, a in zip(before, after, strict=True))
    n = len(before)
    return PairedChange(
        problems=n,
        before=sum(b.greedy_correct for b in before) / n,
        after=sum(a.greedy_correct for a in after) / n,
        gained=gained,
        lost=lost,
    )
