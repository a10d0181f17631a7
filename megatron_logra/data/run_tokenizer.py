"""The tokenizer a run encodes text with, and the embedding size that follows from it.

data.dir's SentencePiece ``tokenizer.model`` by default; a Hugging Face tokenizer directory when
``data.tokenizer`` is set (a converted Qwen / Llama model keeps its own tokenizer). The model's
embedding has ``model.vocab_size`` rows when that is set (a checkpoint may carry more rows than
its tokenizer has ids), else one per tokenizer id; Megatron pads either to
``model.make_vocab_size_divisible_by``.
"""

from __future__ import annotations

from pathlib import Path

from megatron_logra.config import Config
from megatron_logra.data.dataset_dir import TOKENIZER_FILE, load_tokenizer
from megatron_logra.data.hf_tokenizer import HFTokenizer
from megatron_logra.data.prompt_builder import PromptBuilder
from megatron_logra.data.tokenizer import SentencePieceTokenizer

RunTokenizer = HFTokenizer | SentencePieceTokenizer


def load_run_tokenizer(cfg: Config) -> RunTokenizer:
    if cfg.data.tokenizer:
        return HFTokenizer(cfg.data.tokenizer)
    if not (Path(cfg.data.dir) / TOKENIZER_FILE).is_file():
        raise ValueError(
            f"data.tokenizer is unset and data.dir={cfg.data.dir!r} has no {TOKENIZER_FILE} (the "
            "synthetic task's SentencePiece model); set data.tokenizer to the model's Hugging "
            "Face tokenizer directory (OUT_DIR/tokenizer of tools/convert_hf.py to-megatron)"
        )
    return load_tokenizer(cfg.data.dir)


def embedding_rows(cfg: Config, tokenizer: RunTokenizer) -> int:
    """Rows of the word embedding before padding (``model.vocab_size`` or the tokenizer's)."""
    rows = cfg.model.vocab_size
    if rows is None:
        return tokenizer.vocab_size
    if rows < tokenizer.vocab_size:
        raise ValueError(
            f"model.vocab_size={rows} is smaller than the tokenizer's {tokenizer.vocab_size} ids; "
            "set it to the checkpoint's embedding rows (at least the tokenizer's size) or unset "
            "it to follow the tokenizer"
        )
    return rows


def load_prompt_builder(cfg: Config) -> PromptBuilder:
    """The run's tokenizer with its ``data.prompt`` settings: what every engine and the trainer
    encode prompts and supervised targets with, and the stop tokens."""
    return PromptBuilder(load_run_tokenizer(cfg), cfg.data.prompt)
