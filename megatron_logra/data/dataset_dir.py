"""The on-disk layout of a synthetic dataset directory, and the tool that writes it.

    <dir>/corpus.txt       one training problem per line (prompt, space, answer)
    <dir>/train.jsonl      {"prompt": ..., "answer": ...} per line
    <dir>/eval.jsonl       held-out test problems, disjoint from train (what runs report)
    <dir>/valid.jsonl      validation problems for choosing settings, disjoint from both
                           (only with ``num_valid > 0``)
    <dir>/tokenizer.model  SentencePiece model trained on corpus.txt
    <dir>/tokens.npy       corpus.txt tokenized, one EOS after each line (int32)
    <dir>/meta.json        the arguments that produced it

The directory is assembled next to its final place and renamed into it, so a crash never leaves a
half-written dataset that later loads as complete.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from megatron_logra.data.synthetic import (
    OPERATIONS,
    canonical_problems,
    check_operations,
    generate_problems,
)
from megatron_logra.data.tokenizer import SentencePieceTokenizer, train_sentencepiece

TOKENIZER_FILE = "tokenizer.model"
# The held-out problems by rl.eval.split: the test split runs report, the validation split
# settings are chosen on.
EVAL_SPLIT_FILES = {"test": "eval.jsonl", "validation": "valid.jsonl"}
TOKENS_FILE = "tokens.npy"
META_FILE = "meta.json"


@dataclass(frozen=True)
class SyntheticDataSpec:
    num_train: int = 20000
    num_eval: int = 1000
    seed: int = 0
    vocab_size: int = 96
    max_digits: int = 3
    min_digits: int = 1
    operations: tuple[str, ...] = OPERATIONS
    zero_pad: bool = False
    """Operands written with exactly max_digits digits (leading zeros)."""
    num_valid: int = 0
    """Validation problems (valid.jsonl); 0 writes none. Train and eval do not depend on it."""

    def problem_options(self) -> dict:
        """The generate_problems keyword arguments this spec fixes (besides count and split)."""
        return {"seed": self.seed, "max_digits": self.max_digits, "min_digits": self.min_digits,
                "operations": check_operations(self.operations), "zero_pad": self.zero_pad}


def write_synthetic_dataset(out_dir: str | Path, spec: SyntheticDataSpec) -> Path:
    """Create (or replace) a dataset directory for ``spec``; returns its path."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        train = generate_problems(spec.num_train, split="train", **spec.problem_options())
        held_out = generate_problems(spec.num_eval, split="eval", **spec.problem_options())
        lines = [problem.as_text() for problem in train]
        (staging / "corpus.txt").write_text("\n".join(lines) + "\n")
        splits = [("train.jsonl", train), ("eval.jsonl", held_out)]
        if spec.num_valid:
            test_keys = canonical_problems(spec.num_eval, split="eval", **spec.problem_options())
            splits.append(("valid.jsonl", generate_problems(
                spec.num_valid, split="validation", exclude=test_keys, **spec.problem_options()
            )))
        for name, problems in splits:
            with open(staging / name, "w") as handle:
                for problem in problems:
                    handle.write(json.dumps({"prompt": problem.prompt, "answer": problem.answer}))
                    handle.write("\n")
        tokenizer = train_sentencepiece(
            lines, staging / TOKENIZER_FILE, vocab_size=spec.vocab_size, seed=spec.seed
        )
        tokens: list[int] = []
        for line in lines:
            tokens.extend(tokenizer.encode(line))
            tokens.append(tokenizer.eos_id)
        np.save(staging / TOKENS_FILE, np.asarray(tokens, dtype=np.int32))
        meta = {"spec": asdict(spec), "vocab_size": tokenizer.vocab_size, "num_tokens": len(tokens)}
        (staging / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        # mkdtemp creates the staging directory private (0700); the dataset is for everyone.
        staging.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def load_tokenizer(data_dir: str | Path) -> SentencePieceTokenizer:
    return SentencePieceTokenizer(Path(data_dir) / TOKENIZER_FILE)


def load_tokens(data_dir: str | Path) -> np.ndarray:
    path = Path(data_dir) / TOKENS_FILE
    if not path.is_file():
        raise ValueError(
            f"data.dir={str(data_dir)!r} has no {TOKENS_FILE}; create the dataset with "
            f"`python tools/make_synthetic_data.py --out {data_dir}`"
        )
    return np.load(path, mmap_mode="r")
