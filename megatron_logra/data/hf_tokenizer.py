"""Hugging Face tokenizers from a local directory, with the trainer's tokenizer interface.

The same interface as :class:`megatron_logra.data.tokenizer.SentencePieceTokenizer`
(``vocab_size``, ``eos_id``, ``pad_id``, ``encode``, ``decode``). Nothing is downloaded: the
directory must already hold the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``,
...), e.g. the ``tokenizer/`` copy ``tools/convert_hf.py to-megatron`` writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class HFTokenizer:
    """A ``transformers`` tokenizer read with ``local_files_only=True``.

    ``encode`` adds no special tokens (no BOS / EOS), as the SentencePiece tokenizer does: the
    trainer appends EOS itself. ``decode`` drops special tokens, as SentencePiece renders its
    control pieces (EOS) as nothing. Without a pad token, EOS doubles as padding.
    """

    def __init__(self, directory: str | Path) -> None:
        path = Path(directory)
        if not path.is_dir():
            raise ValueError(
                f"tokenizer directory {str(path)!r} does not exist; point at a directory holding "
                "a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json, ...)"
            )
        from transformers import AutoTokenizer

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as error:
            raise ValueError(
                f"tokenizer directory {str(path)!r} holds no loadable Hugging Face tokenizer "
                f"({error}); save one there with save_pretrained"
            ) from error
        if self._tokenizer.eos_token_id is None:
            raise ValueError(
                f"tokenizer in {str(path)!r} has no EOS token; set eos_token in its "
                "tokenizer_config.json"
            )
        self.path = path

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added (special) tokens included."""
        return len(self._tokenizer)

    @property
    def eos_id(self) -> int:
        return int(self._tokenizer.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self._tokenizer.pad_token_id
        return self.eos_id if pad is None else int(pad)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)
