"""A deterministic, verifiable synthetic task family: worded multi-digit arithmetic.

Problems look like ``What is 347 plus 128?`` with the answer ``475``. They serve three purposes:
a language-modelling corpus (prompt and answer on one line), a supervised warm-start set, and RL
prompts whose answers are checked by exact match. Train and held-out eval problems are disjoint
by construction: a problem belongs to the eval split iff a hash of its canonical form (operands
and operation) says so, whatever seed, count, digit range or formatting generated it. A
validation split (for choosing settings) is drawn from the same held-out side with its own
random stream, leaving out the eval split's problems.

The family is tuned by a few knobs: which operations appear, how many digits each operand has
(the digit count is drawn first, uniformly in ``min_digits..max_digits``, then the value), and
whether operands are written zero-padded to ``max_digits`` digits (``What is 047 plus 128?``),
which aligns the digit columns. Answers are always written plainly (``175``).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

OPERATIONS: tuple[str, ...] = ("plus", "minus")
TEMPLATES: tuple[str, ...] = (
    "What is {a} {op} {b}?",
    "Compute {a} {op} {b}.",
    "Calculate {a} {op} {b}.",
)
# One problem in EVAL_EVERY (by canonical hash) is held out for evaluation.
EVAL_EVERY = 8
# Operands are plain ints formatted in decimal; more digits than this stop being "a few digits".
MAX_DIGITS = 9


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str

    def as_text(self) -> str:
        """The corpus / supervised form: prompt, a space, the answer."""
        return f"{self.prompt} {self.answer}"


def _is_eval(a: int, op: str, b: int) -> bool:
    digest = hashlib.blake2b(f"{a}|{op}|{b}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % EVAL_EVERY == 0


def _solve(a: int, op: str, b: int) -> int:
    return a + b if op == "plus" else a - b


def check_operations(operations: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The operations as a tuple, after checking them (non-empty, known, no duplicates)."""
    ops = tuple(operations)
    if not ops or any(op not in OPERATIONS for op in ops) or len(set(ops)) != len(ops):
        raise ValueError(
            f"operations={list(ops)} is not valid; give one or more distinct names of "
            f"{list(OPERATIONS)}"
        )
    return ops


SPLITS: tuple[str, ...] = ("train", "eval", "validation")


def generate_problems(
    count: int, *, seed: int, split: str, max_digits: int = 3, min_digits: int = 1,
    operations: tuple[str, ...] = OPERATIONS, zero_pad: bool = False,
    exclude: frozenset[tuple[int, str, int]] = frozenset(),
) -> list[Problem]:
    """``count`` problems of one split, the same list for the same arguments on any machine.

    Operands have ``min_digits``..``max_digits`` digits; subtraction never goes negative; each
    problem's operation is drawn uniformly from ``operations``. With ``zero_pad`` the operands
    are written with exactly ``max_digits`` digits. ``validation`` problems come from the held-out
    side of the hash partition (never a training problem) with their own random stream; pass
    the eval split's canonical problems as ``exclude`` (:func:`canonical_problems`) to keep the
    two disjoint.
    """
    return [problem for _, problem in _generate(
        count, seed=seed, split=split, max_digits=max_digits, min_digits=min_digits,
        operations=operations, zero_pad=zero_pad, exclude=exclude,
    )]


def canonical_problems(count: int, *, seed: int, split: str, **options) -> frozenset:
    """The ``(a, op, b)`` of :func:`generate_problems` with the same arguments."""
    return frozenset(key for key, _ in _generate(count, seed=seed, split=split, **options))


def _generate(
    count: int, *, seed: int, split: str, max_digits: int = 3, min_digits: int = 1,
    operations: tuple[str, ...] = OPERATIONS, zero_pad: bool = False,
    exclude: frozenset[tuple[int, str, int]] = frozenset(),
) -> list[tuple[tuple[int, str, int], Problem]]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if not 1 <= min_digits <= max_digits <= MAX_DIGITS:
        raise ValueError(
            f"need 1 <= min_digits <= max_digits <= {MAX_DIGITS}, got {min_digits}, {max_digits}"
        )
    ops = check_operations(operations)
    # The random stream of train and eval is unchanged by the validation split's existence.
    rng = random.Random(f"megatron_logra.synthetic|{seed}|{split}")
    want_eval = split != "train"
    width = max_digits if zero_pad else 0
    problems: list[tuple[tuple[int, str, int], Problem]] = []
    while len(problems) < count:
        digits_a = rng.randint(min_digits, max_digits)
        digits_b = rng.randint(min_digits, max_digits)
        a = rng.randint(10 ** (digits_a - 1) if digits_a > 1 else 0, 10**digits_a - 1)
        b = rng.randint(10 ** (digits_b - 1) if digits_b > 1 else 0, 10**digits_b - 1)
        op = rng.choice(ops)
        if op == "minus" and b > a:
            a, b = b, a
        if _is_eval(a, op, b) != want_eval:
            continue
        template = rng.choice(TEMPLATES)
        if (a, op, b) in exclude:
            continue
        prompt = template.format(a=f"{a:0{width}d}", op=op, b=f"{b:0{width}d}")
        problems.append(((a, op, b), Problem(prompt, str(_solve(a, op, b)))))
    return problems
