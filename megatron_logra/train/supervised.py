"""Supervised training (``megatron-logra train`` and ``sft``): dense Adam, dense SGD, LoRA or
LoGRA, on a token corpus (language modelling) or on prompt -> answer data (SFT).

One step: zero grads and sketches -> Megatron's forward/backward schedule over this rank's
microbatches (losses are per-token sums; ``finalize_model_grads`` divides by the global token
count and, for LoGRA, reduces the sketches; on prompt data the step's samples are packed into
token-budget rows, train.packing) -> ``optimizer.step()`` (with the KL step control when
logra.kl_control.enabled: its probe is evenly spaced sequences of the step) -> LR scheduler. The run
around the steps is :mod:`megatron_logra.train.loop`'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_logra.config import Config
from megatron_logra.data.dataset_dir import load_tokens
from megatron_logra.data.lm_batches import LMBatchSchedule, Microbatch
from megatron_logra.data.packed_batches import labelled_lengths, packed_step
from megatron_logra.data.problem_files import load_split
from megatron_logra.data.prompt_builder import PromptBuilder
from megatron_logra.data.prompt_data import SupervisedBatchSchedule
from megatron_logra.data.run_tokenizer import embedding_rows, load_run_tokenizer
from megatron_logra.mcore import (
    ParallelGroups,
    build_model_chunks,
    load_model_weights,
    setup_training,
    train_step,
)
from megatron_logra.packing.plan import layout_multiples
from megatron_logra.probe_batch import supervised_probe_batch
from megatron_logra.train.loop import run
from megatron_logra.train.metrics import memory_bytes


def train(cfg: Config) -> dict[str, Any]:
    """Run ``cfg.train.steps`` supervised steps; returns the last metrics record (every rank)."""
    return run(cfg, SupervisedJob)


def batch_schedule(cfg: Config, tokenizer: Any) -> LMBatchSchedule | SupervisedBatchSchedule:
    """Language modelling on the corpus, or supervised prompt -> target training (the samples
    are the prompt builder's: the prompt ids rollouts see, the target, its stop token)."""
    if cfg.data.format == "prompts":
        return SupervisedBatchSchedule(
            load_split(cfg.data, "train"), PromptBuilder(tokenizer, cfg.data.prompt),
            seq_length=cfg.model.seq_length, global_batch_size=cfg.train.global_batch_size,
            seed=cfg.train.seed,
        )
    return LMBatchSchedule(
        load_tokens(cfg.data.dir),
        seq_length=cfg.model.seq_length,
        global_batch_size=cfg.train.global_batch_size,
        seed=cfg.train.seed,
    )


@dataclass(frozen=True)
class _StepBatch:
    microbatches: list[Microbatch]
    seq_length: int
    """What Megatron's schedule is told (a packed row's length: one per step under PP)."""
    micro_batch_size: int
    processed_tokens: int
    """Tokens the model runs on over all DP ranks, padding included."""
    real_tokens: int
    """Positions up to each sample's last counted label, over all DP ranks."""

    @property
    def packed(self) -> bool:
        return self.microbatches[0].layout is not None

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.processed_tokens


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
        batch = self._batch(step)
        step_metrics = setup.step_metrics()
        control = setup.kl_control
        if control is not None:
            settings = cfg.logra.kl_control
            # The probe takes whole sequences from unpacked rows (packed ones hold several).
            probe_rows = self._unpacked(step) if batch.packed else batch.microbatches
            control.set_batch(supervised_probe_batch(probe_rows, settings,
                                                     dp_rank=groups.data_rank,
                                                     dp_size=groups.data_size))
            if settings.mismatch_input is not None:
                control.observe_mismatch(settings.mismatch_input)
        result = train_step(setup, batch.microbatches, groups=groups,
                            seq_length=batch.seq_length, micro_batch_size=batch.micro_batch_size)
        if groups.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        tokens = batch.processed_tokens
        record = {
            "step": step + 1,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "lr": step_metrics.pop("lr"),
            "tokens": tokens,
            "microbatches": len(batch.microbatches),
            "padding_fraction": batch.padding_fraction,
            "processed_tokens": batch.processed_tokens,
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

    def _unpacked(self, step: int) -> list[Microbatch]:
        return self.schedule.microbatches(
            step, dp_rank=self.groups.data_rank, dp_size=self.groups.data_size,
            micro_batch_size=self.cfg.train.micro_batch_size, device=self.groups.device,
        )

    def _batch(self, step: int) -> _StepBatch:
        """This rank's microbatches of step ``step``: packed (train.packing) or padded."""
        cfg, groups = self.cfg, self.groups
        packing = cfg.train.packing
        if packing.enabled:
            sequence_multiple, row_multiple = layout_multiples(
                cfg.parallel.tp, cfg.parallel.sp, cfg.parallel.cp)
            packed = packed_step(
                self.schedule, step, max_tokens=packing.max_tokens_per_microbatch,
                algorithm=packing.algorithm, dp_rank=groups.data_rank, dp_size=groups.data_size,
                sequence_multiple=sequence_multiple, row_multiple=row_multiple,
                microbatch_multiple=groups.pp_size if groups.vpp_size > 1 else 1,
                uniform_rows=groups.pp_size > 1, device=groups.device,
            )
            plan = packed.plan
            return _StepBatch(packed.microbatches, seq_length=plan.row_length,
                              micro_batch_size=1, processed_tokens=plan.processed_tokens,
                              real_tokens=plan.real_tokens)
        microbatches = self._unpacked(step)
        real = torch.tensor(sum(sum(labelled_lengths(b.loss_mask)) for b in microbatches),
                            dtype=torch.int64, device=groups.device)
        dist.all_reduce(real, group=groups.dp)  # DP x CP: each replica's count cp times
        real //= groups.cp_size
        return _StepBatch(microbatches, seq_length=cfg.model.seq_length,
                          micro_batch_size=cfg.train.micro_batch_size,
                          processed_tokens=cfg.train.global_batch_size * cfg.model.seq_length,
                          real_tokens=int(real))

    def after_step(self, completed: int) -> dict[str, Any]:
        del completed
        return {}

    def checkpoint_state(self) -> dict[str, Any]:
        return {}

    def load_checkpoint_state(self, common: dict[str, Any]) -> None:
        del common

    def close(self) -> None:
        """Nothing outside the model to release."""
