"""A deterministic, verifiable synthetic task family: worded multi-digit arithmetic.

Problems look like ``What is 347 plus 128?`` with the answer ``475``. They serve three purposes:
a language-modelling corpus (prompt and answer on one line), a supervised warm-start set, and RL
prompts whose answers are checked by exact match. Train and held-out eval problems are disjoint
by construction: a problem belongs to the eval split iff a hash of its canonical form says so,
whatever seed or count generated it.
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


def generate_problems(
    count: int, *, seed: int, split: str, max_digits: int = 3, min_digits: int = 1
) -> list[Problem]:
    """``count`` problems of one split, the same list for the same arguments on any machine.

    Operands have ``min_digits``..``max_digits`` digits; subtraction never goes negative.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not 1 <= min_digits <= max_digits <= 9:
        raise ValueError(f"need 1 <= min_digits <= max_digits <= 9, got {min_digits}, {max_digits}")
    rng = random.Random(f"megatron_logra.synthetic|{seed}|{split}")
    want_eval = split == "eval"
    problems: list[Problem] = []
    while len(problems) < count:
        digits_a = rng.randint(min_digits, max_digits)
        digits_b = rng.randint(min_digits, max_digits)
        a = rng.randint(10 ** (digits_a - 1) if digits_a > 1 else 0, 10**digits_a - 1)
        b = rng.randint(10 ** (digits_b - 1) if digits_b > 1 else 0, 10**digits_b - 1)
        op = rng.choice(OPERATIONS)
        if op == "minus" and b > a:
            a, b = b, a
        if _is_eval(a, op, b) != want_eval:
            continue
        template = rng.choice(TEMPLATES)
        problems.append(Problem(template.format(a=a, op=op, b=b), str(_solve(a, op, b))))
    return problems
