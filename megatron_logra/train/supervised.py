"""Supervised training (``megatron-logra train`` and ``sft``): dense Adam, dense SGD, LoRA or
LoGRA, on a token corpus (language modelling) or on prompt -> answer data (SFT).

One step: zero grads and sketches -> Megatron's forward/backward schedule over this rank's
microbatches (losses are per-token sums; ``finalize_model_grads`` divides by the global token
count and, for LoGRA, reduces the sketches) -> ``optimizer.step()`` (with the KL step control when
logra.kl_control.enabled: its probe is the step's first sequences) -> LR scheduler. The run
around the steps is :mod:`megatron_logra.train.loop`'s.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from megatron_logra.config import Config
from megatron_logra.data.dataset_dir import load_tokens
from megatron_logra.data.lm_batches import LMBatchSchedule
from megatron_logra.data.prompt_data import SupervisedBatchSchedule, load_problems
from megatron_logra.data.run_tokenizer import embedding_rows, load_run_tokenizer
from megatron_logra.mcore import (
    ParallelGroups,
    build_model_chunks,
    load_model_weights,
    setup_training,
    train_step,
)
from megatron_logra.probe_batch import supervised_probe_batch
from megatron_logra.train.loop import run
from megatron_logra.train.metrics import memory_bytes


def train(cfg: Config) -> dict[str, Any]:
    """Run ``cfg.train.steps`` supervised steps; returns the last metrics record (every rank)."""
    return run(cfg, SupervisedJob)


def batch_schedule(cfg: Config, tokenizer: Any) -> LMBatchSchedule | SupervisedBatchSchedule:
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


class SupervisedJob:
    """The model, its optimizer and the batch schedule of a supervised run."""

    def __init__(self, cfg: Config, groups: ParallelGroups) -> None:
        self.cfg = cfg
        self.groups = groups
        tokenizer = load_run_tokenizer(cfg)
        self.schedule = batch_schedule(cfg, tokenizer)
        chunks = build_model_chunks(cfg, groups, vocab_size=embedding_rows(cfg, tokenizer))
        if cfg.model.init_checkpoint:
            # Before DDP and the optimizers exist: their fp32 copies start from these weights.
            load_model_weights(cfg.model.init_checkpoint, model_chunks=chunks, cfg=cfg,
                               groups=groups, verify=cfg.checkpoint.verify)
        self.setup = setup_training(cfg, chunks, groups, kl_vocab_size=tokenizer.vocab_size)

    def initial_records(self, start_step: int) -> list[dict[str, Any]]:
        del start_step
        return []

    def step(self, step: int) -> dict[str, Any]:
        cfg, groups, setup = self.cfg, self.groups, self.setup
        start = time.perf_counter()
        # Whole sequences of this data-parallel replica (its CP ranks split them in train_step).
        microbatches = self.schedule.microbatches(
            step, dp_rank=groups.data_rank, dp_size=groups.data_size,
            micro_batch_size=cfg.train.micro_batch_size, device=groups.device,
        )
        step_metrics = setup.step_metrics()
        control = setup.kl_control
        if control is not None:
            settings = cfg.logra.kl_control
            control.set_batch(supervised_probe_batch(microbatches, settings,
                                                     dp_rank=groups.data_rank))
            if settings.mismatch_input is not None:
                control.observe_mismatch(settings.mismatch_input)
        result = train_step(setup, microbatches, groups=groups, seq_length=cfg.model.seq_length,
                            micro_batch_size=cfg.train.micro_batch_size)
        if groups.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        tokens = cfg.train.global_batch_size * cfg.model.seq_length
        record = {
            "step": step + 1,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "lr": step_metrics.pop("lr"),
            "tokens": tokens,
            "step_time_s": elapsed,
            "tokens_per_s": tokens / elapsed,
            "mem_bytes": memory_bytes(groups.device),
        }
        if setup.logra is not None:
            record.update(setup.logra.update_metrics())
            record.update(step_metrics)
        if control is not None:
            record.update(control.metrics(control.realised()))
        return record

    def after_step(self, completed: int) -> dict[str, Any]:
        del completed
        return {}

    def checkpoint_state(self) -> dict[str, Any]:
        return {}

    def load_checkpoint_state(self, common: dict[str, Any]) -> None:
        del common

    def close(self) -> None:
        """Nothing outside the model to release."""
