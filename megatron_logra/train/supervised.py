"""The supervised training loop (``megatron-logra train``): dense Adam, dense SGD or LoGRA.

One step: zero grads and sketches -> Megatron's forward/backward schedule over this rank's
microbatches (losses are per-token sums; ``finalize_model_grads`` divides by the global token
count and, for LoGRA, reduces the sketches) -> ``optimizer.step()`` -> LR scheduler. Rank 0 prints
one line per step and appends the same record to ``<run.dir>/metrics.jsonl``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from megatron_logra.atomic_write import write_atomically
from megatron_logra.config import Config, KLControlConfig
from megatron_logra.data.dataset_dir import load_tokens
from megatron_logra.data.lm_batches import LMBatchSchedule, Microbatch
from megatron_logra.data.prompt_data import SupervisedBatchSchedule, load_problems
from megatron_logra.data.run_tokenizer import embedding_rows, load_run_tokenizer
from megatron_logra.mcore.checkpointing.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
    save_model_checkpoint,
)
from megatron_logra.mcore.kl_probe.step_control import KLStepControl, ProbeBatch
from megatron_logra.mcore.models.full_weights import gather_full_weights, save_tensors_atomically
from megatron_logra.mcore.models.gpt import build_model_chunks
from megatron_logra.mcore.process_groups import ParallelGroups, destroy_parallel, init_parallel
from megatron_logra.mcore.training.setup import TrainingSetup, setup_training
from megatron_logra.mcore.training.state_bytes import gather_state_bytes, write_state_bytes
from megatron_logra.mcore.training.step import train_step
from megatron_logra.train.metric_sinks import metric_sinks
from megatron_logra.train.metrics import MetricsLog, peak_rss_bytes, read_metrics
from megatron_logra.train.preemption import PreemptionFlag

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
STATE_BYTES_FILE = "state_bytes.json"
FULL_WEIGHTS_FILE = "full_weights.pt"
RESOLVED_CONFIG_FILE = "config.yaml"
MODEL_DIR = "model"


def train(cfg: Config) -> dict[str, Any]:
    """Run ``cfg.train.steps`` steps; returns the last metrics record (on every rank)."""
    groups = init_parallel(cfg)
    try:
        return _train(cfg, groups)
    finally:
        destroy_parallel()


def _train(cfg: Config, groups: ParallelGroups) -> dict[str, Any]:
    is_rank0 = groups.world_rank == 0
    run_dir = Path(cfg.run.dir)
    tokenizer = load_run_tokenizer(cfg)
    schedule = _batch_schedule(cfg, tokenizer)
    chunks = build_model_chunks(cfg, groups, vocab_size=embedding_rows(cfg, tokenizer))
    if cfg.model.init_checkpoint:
        # Before DDP and the optimizers exist: their fp32 copies start from these weights.
        load_model_weights(cfg.model.init_checkpoint, model_chunks=chunks, cfg=cfg,
                           groups=groups, verify=cfg.checkpoint.verify)
    setup = setup_training(cfg, chunks, groups)
    control = None
    if cfg.logra.kl_control:
        control = KLStepControl(setup.model_chunks, settings=cfg.kl_control, groups=groups,
                                vocab_size=tokenizer.vocab_size)
        setup.logra.kl_controller = control.controller
    start_step = _maybe_resume(cfg, setup, groups)
    if is_rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        _keep_metrics_up_to(run_dir / METRICS_FILE, start_step)
        (run_dir / RESOLVED_CONFIG_FILE).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    record: dict[str, Any] = {}
    state_bytes: list[dict[str, int]] | None = None
    log = MetricsLog(
        run_dir / METRICS_FILE if is_rank0 else None,
        total_steps=cfg.train.steps,
        console=sys.stdout if is_rank0 else None,
        sinks=metric_sinks(cfg) if is_rank0 else (),
    )
    ckpt = cfg.checkpoint
    with log, PreemptionFlag() as preemption:
        for step in range(start_step, cfg.train.steps):
            record = _train_step(cfg, setup, schedule, groups, step, control)
            if state_bytes is None:
                state_bytes = gather_state_bytes(setup, groups)
                record["state_bytes"] = sum(sum(rank.values()) for rank in state_bytes)
            if is_rank0:
                log.log(record)
            completed = step + 1
            preempted = preemption.agreed(groups.device)
            exiting = cfg.train.exit_interval and completed - start_step >= cfg.train.exit_interval
            due = ckpt.interval and completed % ckpt.interval == 0
            if ckpt.dir and (due or preempted or exiting or completed == cfg.train.steps):
                save_checkpoint(ckpt.dir, step=completed, setup=setup, cfg=cfg, groups=groups)
            if preempted or exiting:
                logger.warning("stopping after step %d (%s)", completed,
                               "SIGTERM" if preempted else "train.exit_interval")
                break
    if is_rank0 and state_bytes is not None:
        write_state_bytes(state_bytes, cfg.optimizer.name, run_dir / STATE_BYTES_FILE)
    if cfg.run.save_model:
        save_model_checkpoint(run_dir, model_chunks=setup.model_chunks, cfg=cfg, groups=groups,
                              name=MODEL_DIR)
    if cfg.run.save_full_weights:
        weights = gather_full_weights(setup.model_chunks, groups)
        if is_rank0:
            save_tensors_atomically(weights, run_dir / FULL_WEIGHTS_FILE)
    return record


def _batch_schedule(cfg: Config, tokenizer: Any) -> LMBatchSchedule | SupervisedBatchSchedule:
    """Language modelling on the corpus, or supervised prompt -> answer training."""
    if cfg.data.format == "prompts":
        return SupervisedBatchSchedule(
            load_problems(Path(cfg.data.dir) / "train.jsonl"), tokenizer,
            seq_length=cfg.model.seq_length, global_batch_size=cfg.train.global_batch_size,
            seed=cfg.train.seed,
        )
    return LMBatchSchedule(
        load_tokens(cfg.data.dir),
        seq_length=cfg.model.seq_length,
        global_batch_size=cfg.train.global_batch_size,
        seed=cfg.train.seed,
    )


def _maybe_resume(cfg: Config, setup: TrainingSetup, groups: ParallelGroups) -> int:
    """Load the newest checkpoint when asked; returns the number of completed steps."""
    if not cfg.checkpoint.resume:
        return 0
    path = latest_checkpoint(cfg.checkpoint.dir)
    if path is None:
        logger.warning("checkpoint.resume=true but %s holds no complete checkpoint: starting "
                       "from step 0", cfg.checkpoint.dir)
        return 0
    common = load_checkpoint(path, setup=setup, cfg=cfg, groups=groups,
                             verify=cfg.checkpoint.verify)
    logger.info("resumed from %s (step %d)", path, common["step"])
    return int(common["step"])


def _keep_metrics_up_to(path: Path, step: int) -> None:
    """A fresh run starts a new metrics file; a resumed one keeps the records up to its
    checkpoint and drops any written after it by the interrupted run."""
    if step == 0 or not path.is_file():
        path.unlink(missing_ok=True)
        return
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    write_atomically(path, "".join(json.dumps(r, allow_nan=True) + "\n" for r in kept))


def _probe_batch(
    microbatches: list[Microbatch], settings: KLControlConfig, *, dp_rank: int
) -> ProbeBatch:
    """The KL probe of a supervised step: the first ``probe_responses`` sequences of the global
    batch that this DP rank holds (possibly none), every label position counted, at most
    ``probe_max_tokens`` positions each."""
    per_rank = sum(batch.tokens.shape[0] for batch in microbatches)
    rows = max(0, min(settings.probe_responses - dp_rank * per_rank, per_rank))
    tokens = torch.cat([batch.tokens for batch in microbatches])[:rows]
    length = min(settings.probe_max_tokens, tokens.shape[1])
    return ProbeBatch(
        tokens=tokens[:, :length],
        position_ids=torch.cat([batch.position_ids for batch in microbatches])[:rows, :length],
        mask=torch.cat([batch.loss_mask for batch in microbatches])[:rows, :length] > 0,
    )


def _train_step(
    cfg: Config,
    setup: TrainingSetup,
    schedule: LMBatchSchedule | SupervisedBatchSchedule,
    groups: ParallelGroups,
    step: int,
    control: KLStepControl | None = None,
) -> dict[str, Any]:
    """One optimizer step (0-based ``step``); returns its metrics record."""
    start = time.perf_counter()
    microbatches = schedule.microbatches(
        step, dp_rank=groups.dp_rank, dp_size=groups.dp_size,
        micro_batch_size=cfg.train.micro_batch_size, device=groups.device,
    )
    lr = float(setup.optimizer.param_groups[0]["lr"])
    if control is not None:
        control.set_batch(_probe_batch(microbatches, cfg.kl_control, dp_rank=groups.dp_rank))
        if cfg.kl_control.mismatch_input is not None:
            control.observe_mismatch(cfg.kl_control.mismatch_input)
    result = train_step(setup, microbatches, groups=groups, seq_length=cfg.model.seq_length,
                        micro_batch_size=cfg.train.micro_batch_size, control=control)
    if groups.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    record = {
        "step": step + 1,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "lr": lr,
        "tokens": tokens,
        "step_time_s": elapsed,
        "tokens_per_s": tokens / elapsed,
        "mem_bytes": _memory_bytes(groups),
    }
    if setup.logra is not None:
        record["logra_update_count"] = setup.logra.update_count
        if cfg.logra.mode == "paper":
            # No learning rate: the update ratio (and the KL controller's alpha) size the step.
            record["lr"] = None
            record["update_ratio"] = cfg.logra.update_ratio
    if control is not None:
        record.update(control.metrics(control.realised()))
    return record


def _memory_bytes(groups: ParallelGroups) -> int:
    if groups.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(groups.device))
    return peak_rss_bytes()
