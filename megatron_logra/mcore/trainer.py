"""The supervised training loop (``megatron-logra train``): dense Adam, dense SGD or LoGRA.

One step: zero grads and sketches -> Megatron's forward/backward schedule over this rank's
microbatches (losses are per-token sums; ``finalize_model_grads`` divides by the global token
count and, for LoGRA, reduces the sketches) -> ``optimizer.step()`` -> LR scheduler. Rank 0 prints
one line per step and appends the same record to ``<run.dir>/metrics.jsonl``.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_logra.config import Config
from megatron_logra.data.dataset_dir import load_tokenizer, load_tokens
from megatron_logra.data.lm_batches import LMBatchSchedule, Microbatch
from megatron_logra.mcore.model import build_model_chunks
from megatron_logra.mcore.parallel import ParallelGroups, destroy_parallel, init_parallel
from megatron_logra.mcore.state_bytes import persistent_state_bytes
from megatron_logra.mcore.training_setup import TrainingSetup, setup_training
from megatron_logra.mcore.weights import gather_full_weights, save_tensors_atomically
from megatron_logra.metric_sinks import metric_sinks
from megatron_logra.metrics import MetricsLog, peak_rss_bytes

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
STATE_BYTES_FILE = "state_bytes.json"
FULL_WEIGHTS_FILE = "full_weights.pt"
RESOLVED_CONFIG_FILE = "config.yaml"


def _loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of per-token losses and the token count (Megatron's per-token-loss convention)."""
    loss_sum = (output_tensor.float() * loss_mask).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm_loss": report}


def _forward_step(data_iterator: Iterator[Microbatch], model: torch.nn.Module) -> tuple[Any, Any]:
    batch = next(data_iterator)
    output = model(batch.tokens, batch.position_ids, None, labels=batch.labels)
    return output, functools.partial(_loss_func, batch.loss_mask)


def _global_loss(losses: list[dict[str, torch.Tensor]], groups: ParallelGroups) -> float:
    """Token-mean loss over the global batch. Only last-stage ranks hold losses; summing
    (loss_sum, tokens) over the world counts every TP replica equally, so the ratio is exact."""
    total = torch.zeros(2, dtype=torch.float64, device=groups.device)
    for record in losses:
        total += record["lm_loss"].to(torch.float64)
    dist.all_reduce(total)
    return float(total[0] / total[1])


def _write_json_atomically(data: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def _gather_state_bytes(setup: TrainingSetup, groups: ParallelGroups) -> list[dict[str, int]]:
    mine = persistent_state_bytes(setup)
    everyone: list[dict[str, int] | None] = [None] * groups.world_size
    dist.all_gather_object(everyone, mine)
    return [entry or {} for entry in everyone]


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
    if is_rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / METRICS_FILE).unlink(missing_ok=True)
        (run_dir / RESOLVED_CONFIG_FILE).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    tokenizer = load_tokenizer(cfg.data.dir)
    schedule = LMBatchSchedule(
        load_tokens(cfg.data.dir),
        seq_length=cfg.model.seq_length,
        global_batch_size=cfg.train.global_batch_size,
        seed=cfg.train.seed,
    )
    chunks = build_model_chunks(cfg, groups, vocab_size=tokenizer.vocab_size)
    setup = setup_training(cfg, chunks, groups)
    forward_backward = get_forward_backward_func()
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
    record: dict[str, Any] = {}
    state_bytes: list[dict[str, int]] | None = None
    log = MetricsLog(
        run_dir / METRICS_FILE if is_rank0 else None,
        total_steps=cfg.train.steps,
        console=sys.stdout if is_rank0 else None,
        sinks=metric_sinks(cfg) if is_rank0 else (),
    )
    with log:
        for step in range(cfg.train.steps):
            start = time.perf_counter()
            for chunk in setup.model_chunks:
                chunk.zero_grad_buffer()
            setup.optimizer.zero_grad()
            microbatches = schedule.microbatches(
                step, dp_rank=groups.dp_rank, dp_size=groups.dp_size,
                micro_batch_size=cfg.train.micro_batch_size, device=groups.device,
            )
            lr = float(setup.optimizer.param_groups[0]["lr"])
            # Every chunk (virtual stage) walks the same microbatches in the schedule's order.
            iterators = [iter(microbatches) for _ in setup.model_chunks]
            losses = forward_backward(
                forward_step_func=_forward_step,
                data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=setup.model_chunks,
                num_microbatches=len(microbatches),
                seq_length=cfg.model.seq_length,
                micro_batch_size=cfg.train.micro_batch_size,
                forward_only=False,
            )
            success, grad_norm, _ = setup.optimizer.step()
            if not success:
                raise RuntimeError(f"optimizer step {step + 1} reported failure")
            setup.scheduler.step(1)
            loss = _global_loss(losses, groups)
            if groups.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            record = {
                "step": step + 1,
                "loss": loss,
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "lr": lr,
                "tokens": tokens_per_step,
                "step_time_s": elapsed,
                "tokens_per_s": tokens_per_step / elapsed,
                "mem_bytes": _memory_bytes(groups),
            }
            if setup.logra is not None:
                record["logra_update_count"] = setup.logra.update_count
            if state_bytes is None:
                state_bytes = _gather_state_bytes(setup, groups)
                record["state_bytes"] = sum(sum(rank.values()) for rank in state_bytes)
            if is_rank0:
                log.log(record)
    if is_rank0 and state_bytes is not None:
        _write_json_atomically(
            {"method": cfg.optimizer.name, "per_rank": state_bytes,
             "total": {k: sum(r.get(k, 0) for r in state_bytes) for k in state_bytes[0]}},
            run_dir / STATE_BYTES_FILE,
        )
    if cfg.run.save_full_weights:
        weights = gather_full_weights(setup.model_chunks, groups)
        if is_rank0:
            save_tensors_atomically(weights, run_dir / FULL_WEIGHTS_FILE)
    return record


def _memory_bytes(groups: ParallelGroups) -> int:
    if groups.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(groups.device))
    return peak_rss_bytes()
