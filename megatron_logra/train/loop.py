"""The run loop shared by ``train``, ``sft`` and ``rl``: one lifecycle, many jobs.

A command is a :class:`Job` (what one step does); this module owns everything around the steps,
the same for every command:

1. process groups up (and down at the end, whatever happens);
2. resume from the newest complete checkpoint when asked (the job restores its own extra state);
3. ``run.dir``: metrics kept up to the resumed step, the resolved config written;
4. the steps: a record per step, on the console and in metrics.jsonl (and its mirrors), the
   persistent state bytes after the first step (optimizer state is allocated lazily), the job's
   end-of-step additions (RL's held-out evaluations);
5. checkpoints every ``checkpoint.interval`` steps, at the end, on SIGTERM (agreed on by every
   rank; each rank then records the save for the launch script, see preemption.py) and when
   ``train.exit_interval`` ends the invocation early;
6. at the end: state_bytes.json, the model-only checkpoint (run.save_model), the full weights
   (run.save_full_weights) and the plots.

Exit codes are the CLI's: a ValueError (a user-fixable problem) becomes exit code 2 there.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from megatron_logra.config import Config
from megatron_logra.mcore import (
    ParallelGroups,
    TrainingSetup,
    destroy_parallel,
    gather_full_weights,
    gather_state_bytes,
    init_parallel,
    latest_checkpoint,
    load_checkpoint,
    remove_stale_staging,
    save_checkpoint,
    save_model_checkpoint,
    save_tensors_atomically,
    state_bytes_totals,
    write_state_bytes,
)
from megatron_logra.train.metric_sinks import metric_sinks
from megatron_logra.train.metrics import MetricsLog
from megatron_logra.train.plots import plot_metrics
from megatron_logra.train.preemption import PreemptionFlag, record_preempted_save
from megatron_logra.train.run_files import (
    FULL_WEIGHTS_FILE,
    METRICS_FILE,
    MODEL_DIR,
    STATE_BYTES_FILE,
    prepare_run_dir,
)

logger = logging.getLogger(__name__)


class Job(Protocol):
    """What a command trains. Built once (models, optimizer, data), then stepped."""

    setup: TrainingSetup

    def initial_records(self, start_step: int) -> list[dict[str, Any]]:
        """Records to log before the first step of this invocation (RL: the evaluation of the
        starting policy on a fresh run)."""
        ...

    def step(self, step: int) -> dict[str, Any]:
        """Run step ``step`` (0-based); its metrics record, ``"step": step + 1`` first."""
        ...

    def after_step(self, completed: int) -> dict[str, Any]:
        """Fields to add to the record of the step that made ``completed`` steps (RL: a
        held-out evaluation when one is due)."""
        ...

    def checkpoint_state(self) -> dict[str, Any]:
        """Extra common state for the checkpoint (RL: the running baseline)."""
        ...

    def load_checkpoint_state(self, common: dict[str, Any]) -> None:
        """Restore what :meth:`checkpoint_state` saved, from a checkpoint's common state."""
        ...

    def close(self) -> None:
        """Release what the job holds outside the model (reward worker processes)."""
        ...


def run(cfg: Config, build_job: Callable[[Config, ParallelGroups], Job]) -> dict[str, Any]:
    """Run ``cfg.train.steps`` steps of the job ``build_job`` makes; returns the last metrics
    record (on every rank)."""
    groups = init_parallel(cfg)
    try:
        job = build_job(cfg, groups)
        try:
            record, preempted_save = _run(cfg, groups, job)
        finally:
            job.close()
    finally:
        destroy_parallel()
    if preempted_save is not None:
        record_preempted_save(preempted_save)
    return record


def _resume(cfg: Config, job: Job, groups: ParallelGroups) -> int:
    """Load the newest checkpoint when asked; returns the number of completed steps."""
    if not cfg.checkpoint.resume:
        return 0
    path = latest_checkpoint(cfg.checkpoint.dir)
    if path is None:
        logger.warning("checkpoint.resume=true but %s holds no complete checkpoint: starting "
                       "from step 0", cfg.checkpoint.dir)
        return 0
    common = load_checkpoint(path, setup=job.setup, cfg=cfg, groups=groups,
                             verify=cfg.checkpoint.verify)
    job.load_checkpoint_state(common)
    logger.info("resumed from %s (step %d)", path, common["step"])
    return int(common["step"])


def _run(cfg: Config, groups: ParallelGroups, job: Job) -> tuple[dict[str, Any], int | None]:
    """The steps; returns the last record and, when SIGTERM stopped the run after a
    checkpoint, the step that checkpoint holds."""
    is_rank0 = groups.world_rank == 0
    run_dir = Path(cfg.run.dir)
    # Before anything is saved: a killed save of an earlier run may have left staging
    # directories (in the checkpoint directory, or the run directory's model save).
    for directory in sorted({cfg.checkpoint.dir, cfg.run.dir} - {None, ""}):
        remove_stale_staging(directory, groups)
    start_step = _resume(cfg, job, groups)
    if is_rank0:
        prepare_run_dir(cfg, start_step)
    log = MetricsLog(
        run_dir / METRICS_FILE if is_rank0 else None,
        total_steps=cfg.train.steps,
        console=sys.stdout if is_rank0 else None,
        sinks=metric_sinks(cfg) if is_rank0 else (),
    )
    record: dict[str, Any] = {}
    state_bytes: list[dict[str, int]] | None = None
    preempted_save: int | None = None
    ckpt = cfg.checkpoint
    with log, PreemptionFlag() as preemption:
        for initial in job.initial_records(start_step):
            if is_rank0:
                log.log(initial)
        step = start_step
        try:
            for step in range(start_step, cfg.train.steps):
                record = job.step(step)
                if state_bytes is None:
                    # After the first step: Adam allocates its moments lazily.
                    state_bytes = gather_state_bytes(job.setup, groups)
                    record.update(state_bytes_totals(state_bytes))
                completed = step + 1
                record.update(job.after_step(completed))
                if is_rank0:
                    log.log(record)
                preempted = preemption.agreed(groups.device)
                exiting = (cfg.train.exit_interval
                           and completed - start_step >= cfg.train.exit_interval)
                due = ckpt.interval and completed % ckpt.interval == 0
                if ckpt.dir and (due or preempted or exiting or completed == cfg.train.steps):
                    save_checkpoint(ckpt.dir, step=completed, setup=job.setup, cfg=cfg,
                                    groups=groups, extra_common=job.checkpoint_state())
                if preempted and ckpt.dir:
                    preempted_save = completed
                if preempted or exiting:
                    logger.warning("stopping after step %d (%s)", completed,
                                   "SIGTERM" if preempted else "train.exit_interval")
                    break
        except Exception as error:
            _explain_failure(error, cfg, groups, step + 1)
            raise
    _finish(cfg, groups, job, state_bytes)
    return record, preempted_save


def _explain_failure(error: Exception, cfg: Config, groups: ParallelGroups, step: int) -> None:
    """Say, on the rank that fails, which step failed, what a collective timeout means and what
    a resume would start from (a note on the exception, so its type and exit code stay)."""
    lines = [f"rank {groups.world_rank} of {groups.world_size} failed during step {step}"]
    if groups.world_size > 1:
        # A dead rank is seen by the others only as a collective that never completes.
        lines.append(
            f"if another rank died, the surviving ranks stop within "
            f"parallel.collective_timeout_s={cfg.parallel.collective_timeout_s:g} s of its death "
            "(a gloo or NCCL timeout or a closed connection above is how that shows)")
    if cfg.checkpoint.dir:
        newest = latest_checkpoint(cfg.checkpoint.dir)
        lines.append(f"newest complete checkpoint: {newest or 'none'}; rerun with "
                     "checkpoint.resume=true to continue from it")
    note = "; ".join(lines)
    error.add_note(note)
    logger.error("%s: %s: %s", note, type(error).__name__, str(error).splitlines()[0] if str(error) else "")


def _finish(
    cfg: Config, groups: ParallelGroups, job: Job, state_bytes: list[dict[str, int]] | None
) -> None:
    is_rank0 = groups.world_rank == 0
    run_dir = Path(cfg.run.dir)
    if is_rank0 and state_bytes is not None:
        write_state_bytes(state_bytes, cfg.optimizer.name, run_dir / STATE_BYTES_FILE)
    if cfg.run.save_model:
        save_model_checkpoint(run_dir, model_chunks=job.setup.model_chunks, cfg=cfg,
                              groups=groups, name=MODEL_DIR)
        if is_rank0:
            logger.info("final model: %s (model.init_checkpoint of a later run loads it; "
                        "`python tools/convert_hf.py to-hf %s OUT_DIR` writes a Hugging Face "
                        "directory)", run_dir / MODEL_DIR, run_dir / MODEL_DIR)
    elif is_rank0:
        logger.info("run.save_model=false: the final weights were not saved (checkpoints, if "
                    "any, are in checkpoint.dir=%s)", cfg.checkpoint.dir)
    if cfg.run.save_full_weights:
        weights = gather_full_weights(job.setup.model_chunks, groups)
        if is_rank0:
            save_tensors_atomically(weights, run_dir / FULL_WEIGHTS_FILE)
    if is_rank0:
        for path in plot_metrics(run_dir / METRICS_FILE):
            logger.info("plot: %s", path)
