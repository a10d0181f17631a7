"""Hugging Face tokenizers from a local directory, with the trainer's tokenizer interface.

The same interface as :class:`megatron_logra.data.tokenizer.SentencePieceTokenizer`
(``vocab_size``, ``eos_id``, ``pad_id``, ``encode``, ``decode``). Nothing is downloaded: the
directory must already hold the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``,
...), e.g. the ``tokenizer/`` copy ``tools/convert_hf.py to-megatron`` writes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Beside the tokenizer files (tools/convert_hf.py copies the model's there): its eos_token_id,
# one id or a list, is where the model's generation ends (Qwen: <|im_end|> and <|endoftext|>).
GENERATION_CONFIG_FILE = "generation_config.json"


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

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    def render_chat(self, turns: Sequence[tuple[str, str]], *, add_generation_prompt: bool,
                    template_kwargs: Mapping[str, Any]) -> str:
        """The chat template's text of ``(role, content)`` turns (special tokens as text)."""
        messages = [{"role": role, "content": content} for role, content in turns]
        return self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            **dict(template_kwargs))

    @property
    def generation_stop_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` of the directory's generation_config.json (none without one)."""
        path = self.path / GENERATION_CONFIG_FILE
        if not path.is_file():
            return ()
        value = json.loads(path.read_text()).get("eos_token_id")
        values = [] if value is None else [value] if isinstance(value, int) else value
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError(f"{path}: eos_token_id={value!r} must be a token id or a list of "
                             "them")
        return tuple(values)

    def is_special(self, token_id: int) -> bool:
        """A special (added, control) token: never part of a response's text."""
        added = self._tokenizer.added_tokens_decoder.get(token_id)
        return token_id in self._tokenizer.all_special_ids or bool(added and added.special)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)
