"""The ``train``, ``data``, ``run`` and ``checkpoint`` sections: the step count and batch, the
data, where results go, and checkpointing."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_logra.config.checks import check_choice, check_positive, validate_subsections
from megatron_logra.config.packing import PackingConfig

DATA_FORMATS: tuple[str, ...] = ("corpus", "prompts")
WANDB_MODES: tuple[str, ...] = ("off", "offline", "online")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 20
    micro_batch_size: int = 4
    global_batch_size: int = 8
    """Sequences per optimizer step over all data-parallel ranks (``rl`` derives it from
    rl.prompts_per_step x rl.samples_per_prompt)."""
    seed: int = 1234
    """Seeds model initialisation and data order (not the projections: logra.seed)."""
    exit_interval: int = 0
    """Stop (after checkpointing, when checkpoint.dir is set) once this many steps ran in this
    invocation, e.g. to fit a job into a scheduler's time slot; 0 runs to train.steps."""
    packing: PackingConfig = field(default_factory=PackingConfig)
    """Sequence packing with a token budget per microbatch (config/packing.py)."""

    def validate(self, path: str = "train") -> None:
        for name in ("steps", "micro_batch_size", "global_batch_size"):
            check_positive(f"{path}.{name}", getattr(self, name))
        check_positive(f"{path}.seed", self.seed, allow_zero=True)
        check_positive(f"{path}.exit_interval", self.exit_interval, allow_zero=True)
        validate_subsections(self, path)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    dir: str = ".data/synthetic"
    """A directory made by ``tools/make_synthetic_data.py``: tokens.npy (corpus), train.jsonl /
    eval.jsonl (prompts and answers) and tokenizer.model."""
    format: str = "corpus"
    """``corpus``: language modelling on tokens.npy; ``prompts``: supervised prompt -> answer
    training on train.jsonl (the loss on the answer and EOS only)."""
    tokenizer: str | None = None
    """A local Hugging Face tokenizer directory (e.g. the ``tokenizer/`` that
    ``tools/convert_hf.py to-megatron`` writes) to encode train.jsonl / eval.jsonl with, in place
    of data.dir's tokenizer.model. Prompt data only: the corpus of ``format: corpus`` is stored
    already tokenized."""

    def validate(self, path: str = "data") -> None:
        if not self.dir:
            raise ValueError(f"{path}.dir is empty; point it at a directory made by "
                             "tools/make_synthetic_data.py")
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


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    dir: str = "runs/default"
    """Where metrics.jsonl, the resolved config and run summaries are written."""
    save_full_weights: bool = False
    """Gather the full (unsharded) weights at the end into ``<run.dir>/full_weights.pt``, keyed by
    layout-independent names; used to compare runs across parallel layouts."""
    save_model: bool = False
    """Write a model-only checkpoint of the final weights to ``<run.dir>/model`` (what
    model.init_checkpoint of a later run loads, e.g. a warm start for RL)."""
    tensorboard: bool = False
    """Mirror the metrics to TensorBoard event files in ``<run.dir>/tensorboard``."""
    wandb: str = "off"
    """Mirror the metrics to Weights & Biases: ``off``, ``offline`` (files under run.dir) or
    ``online``."""
    wandb_project: str = "megatron-logra"

    def validate(self, path: str = "run") -> None:
        if not self.dir:
            raise ValueError(f"{path}.dir is empty; give the run a directory")
        check_choice(f"{path}.wandb", self.wandb, WANDB_MODES)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Distributed checkpoints (reshardable across TP/PP/DP layouts, written atomically)."""

    dir: str | None = None
    """Directory of the run's checkpoints; None disables checkpointing."""
    interval: int = 0
    """Save every this many steps (0: only at the end of training and on SIGTERM)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in ``dir`` (start fresh if there is none)."""
    verify: bool = True
    """Check every checkpoint file's size and SHA-256 against the manifest before loading."""

    def validate(self, path: str = "checkpoint") -> None:
        check_positive(f"{path}.interval", self.interval, allow_zero=True)
        if self.dir is None and (self.resume or self.interval):
            raise ValueError(
                f"{path}.resume / {path}.interval need {path}.dir; set "
                f"{path}.dir=<directory>"
            )
