"""Tokenizers from local files: SentencePiece models the project trains for its synthetic data.

Nothing is downloaded: a tokenizer is a file on disk.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm

from megatron_logra.atomic_write import write_atomically


class SentencePieceTokenizer:
    """A SentencePiece model with the ids the trainer needs (EOS doubles as padding)."""

    def __init__(self, model_path: str | Path) -> None:
        path = Path(model_path)
        if not path.is_file():
            raise ValueError(
                f"tokenizer model {str(path)!r} does not exist; create it with "
                "tools/make_synthetic_data.py"
            )
        self.path = path
        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        if self._sp.eos_id() < 0:
            raise ValueError(f"tokenizer {str(path)!r} has no EOS piece")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        return self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))


def train_sentencepiece(
    lines: Iterable[str], model_path: str | Path, *, vocab_size: int, seed: int = 0
) -> SentencePieceTokenizer:
    """Train a small BPE model (digits split, so numbers are spelled digit by digit)."""
    del seed  # SentencePiece's BPE trainer is deterministic for a given input order.
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(lines)),
        model_writer=buffer,
        model_type="bpe",
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        split_digits=True,
        character_coverage=1.0,
        num_threads=1,
        bos_id=-1,
        eos_id=1,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
    )
    path = Path(model_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, buffer.getvalue())
    return SentencePieceTokenizer(path)
