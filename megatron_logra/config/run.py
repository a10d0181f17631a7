"""The ``train``, ``run`` and ``checkpoint`` sections: the step count and batch, where results go,
and checkpointing (the ``data`` section is config/data.py's)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from megatron_logra.config.checks import check_choice, check_positive, validate_subsections
from megatron_logra.config.packing import PackingConfig

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
    """Directory of the run's checkpoints. None: ``<run.dir>/checkpoints`` when ``interval`` or
    ``resume`` asks for checkpoints (each run's own: two runs of one preset, an ``sft`` and an
    ``rl``, never share one), else no checkpointing."""
    interval: int = 0
    """Save every this many steps (0: only at the end of training and on SIGTERM)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in ``dir`` (start fresh if there is none)."""
    verify: bool = True
    """Check every checkpoint file's size and SHA-256 against the manifest before loading."""

    def validate(self, path: str = "checkpoint") -> None:
        check_positive(f"{path}.interval", self.interval, allow_zero=True)

    def in_run(self, run_dir: str) -> CheckpointConfig:
        """This config with ``dir`` filled in: ``<run_dir>/checkpoints`` where it is None and
        checkpoints are asked for."""
        if self.dir is not None or not (self.interval or self.resume):
            return self
        return dataclasses.replace(self, dir=str(Path(run_dir) / "checkpoints"))
