"""The ``data`` section: where the problems and the tokenizer are, how a row of a problem file is
read, and how a prompt becomes the text the model sees (``data.prompt``).

A problem file is JSONL or Parquet (by its suffix). A row's prompt (``data.prompt_key``) is a
string or a chat ``messages`` list (``[{"role": ..., "content": ...}, ...]``); its answer
(``data.answer_key``) is what the reward grades against; the supervised target is
``data.response_key``'s text when set, else the trailing assistant turn of a messages prompt,
else the answer. Keys are dotted paths into nested rows (verl's ``reward_model.ground_truth``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from megatron_logra.config.checks import check_choice

DATA_FORMATS: tuple[str, ...] = ("corpus", "prompts")
PROBLEM_FILE_SUFFIXES: tuple[str, ...] = (".jsonl", ".parquet")
# The split files looked for in data.dir when data.<split>_file is unset, in this order; two of
# them present is ambiguous and refused (megatron_logra.data.problem_files).
SPLIT_CANDIDATES: dict[str, tuple[str, ...]] = {
    "train": ("train.jsonl", "train.parquet"),
    "test": ("eval.jsonl", "test.jsonl", "eval.parquet", "test.parquet"),
    "validation": ("valid.jsonl", "validation.jsonl", "valid.parquet", "validation.parquet"),
}
PROMPT_PLACEHOLDER = "{prompt}"


@dataclass(frozen=True, kw_only=True)
class PromptConfig:
    """How a problem's prompt becomes the token ids every engine and the trainer see
    (``megatron_logra.data.prompt_builder``, the one place that builds them)."""

    chat_template: bool = False
    """Apply the tokenizer's own chat template to ``[system?, user]`` (or the row's messages)
    with the generation prompt; false encodes the (templated) prompt text as it is."""
    system_prompt: str | None = None
    """A system turn put before every prompt (needs chat_template)."""
    user_template: str | None = None
    """The user text, with ``{prompt}`` replaced by the row's prompt (the last user turn of a
    messages prompt), e.g. ``"{prompt}\\nPlease put your final answer within \\boxed{}."``."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template, e.g. ``{enable_thinking: false}`` (needs
    chat_template)."""

    def validate(self, path: str = "data.prompt") -> None:
        if self.user_template is not None and PROMPT_PLACEHOLDER not in self.user_template:
            raise ValueError(
                f"{path}.user_template={self.user_template!r} has no {PROMPT_PLACEHOLDER} for the "
                f"row's prompt; write it where the prompt goes, e.g. "
                f"'{PROMPT_PLACEHOLDER}\\nAnswer with a number.'"
            )
        if self.system_prompt is not None and not self.system_prompt.strip():
            raise ValueError(f"{path}.system_prompt is empty; unset it for no system turn")
        for name, value, empty in (("system_prompt", self.system_prompt, None),
                                   ("template_kwargs", self.template_kwargs, {})):
            if value != empty and not self.chat_template:
                raise ValueError(
                    f"{path}.{name}={value!r} needs {path}.chat_template=true: a plain-text "
                    f"prompt has no system turn or template; set {path}.chat_template=true, or "
                    f"drop it (put fixed text in {path}.user_template instead)"
                )


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    dir: str = ".data/synthetic"
    """The dataset directory: problem files (train.jsonl / eval.jsonl or test.jsonl, or
    Parquet) for prompt data; tokens.npy and tokenizer.model of ``tools/make_synthetic_data.py``
    for the corpus and the synthetic task."""
    format: str = "corpus"
    """``corpus``: language modelling on tokens.npy; ``prompts``: supervised prompt -> answer
    training on the train split (the loss on the answer and its stop token only)."""
    tokenizer: str | None = None
    """A local Hugging Face tokenizer directory (e.g. the ``tokenizer/`` that
    ``tools/convert_hf.py to-megatron`` writes) to encode the problems with, in place of
    data.dir's tokenizer.model. Prompt data only: the corpus of ``format: corpus`` is stored
    already tokenized."""
    train_file: str | None = None
    """The training problems, relative to data.dir (or absolute); unset: the one of
    train.jsonl / train.parquet in data.dir."""
    test_file: str | None = None
    """The held-out problems runs report (rl.eval.split=test); unset: the one of eval.jsonl,
    test.jsonl, eval.parquet, test.parquet in data.dir."""
    validation_file: str | None = None
    """The problems settings are chosen on (rl.eval.split=validation); unset: the one of
    valid.jsonl, validation.jsonl, valid.parquet, validation.parquet in data.dir."""
    prompt_key: str = "prompt"
    """The row's prompt: a string or a messages list; a dotted path reads nested fields."""
    answer_key: str = "answer"
    """The row's reference answer for the reward (a string or a number), e.g.
    ``reward_model.ground_truth`` in verl's files."""
    response_key: str | None = None
    """The supervised target (sft); unset: a messages prompt's trailing assistant turn, else the
    answer."""
    prompt: PromptConfig = field(default_factory=PromptConfig)

    def validate(self, path: str = "data") -> None:
        if not self.dir:
            raise ValueError(f"{path}.dir is empty; point it at the dataset directory")
        check_choice(f"{path}.format", self.format, DATA_FORMATS)
        if self.tokenizer is not None and not self.tokenizer:
            raise ValueError(f"{path}.tokenizer is empty; point it at a Hugging Face tokenizer "
                             f"directory or leave it unset to use {path}.dir's tokenizer.model")
        if self.tokenizer is not None and self.format != "prompts":
            raise ValueError(
                f"{path}.tokenizer={self.tokenizer!r} needs {path}.format=prompts (got "
                f"{self.format!r}): the corpus is stored already tokenized by {path}.dir's "
                f"tokenizer; drop {path}.tokenizer or train on prompt data"
            )
        for name in ("train_file", "test_file", "validation_file"):
            value = getattr(self, name)
            if value is not None and PurePath(value).suffix not in PROBLEM_FILE_SUFFIXES:
                raise ValueError(
                    f"{path}.{name}={value!r} is not a problem file; name a "
                    f"{' or '.join(PROBLEM_FILE_SUFFIXES)} file (the suffix says which format)"
                )
        for name in ("prompt_key", "answer_key", "response_key"):
            value = getattr(self, name)
            if value is not None and (not value or not all(value.split("."))):
                raise ValueError(f"{path}.{name}={value!r} is not a key; give a column name or "
                                 "a dotted path such as reward_model.ground_truth")
        self.prompt.validate(f"{path}.prompt")
        if self.format == "prompts" and self.prompt.chat_template and self.tokenizer is None:
            raise ValueError(
                f"{path}.prompt.chat_template=true applies a Hugging Face tokenizer's chat "
                f"template; set {path}.tokenizer to the model's tokenizer directory (e.g. "
                f"OUT_DIR/tokenizer of tools/convert_hf.py) or set {path}.prompt.chat_template="
                "false"
            )
