"""Peak live tensor storage of one steady-state training step of the model the product builds.

What ``megatron-logra train`` does per step, counted by
:class:`megatron_logra.memory.live_tensors.LiveTensorTracker`: the run's own model, DDP and
optimizer (``setup_training``), one global batch of random tokens, and -- with
``logra.kl_control.enabled`` -- the probe batch of a supervised step and the realised-KL pass
after the update, as the supervised loop runs them. A warm-up step first allocates the
optimizer state; everything alive after it is the persistent state (labelled by category), and
the peak is that of the next step. The estimator (:mod:`megatron_logra.memory.estimate`) is
checked against this (tools/estimate_vs_measured.py, tests/unit/test_estimate_vs_measured.py).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_logra.config import Config
from megatron_logra.data.lm_batches import Microbatch
from megatron_logra.mcore.models.gpt import build_model_chunks
from megatron_logra.mcore.peft.lora import lora_adapters
from megatron_logra.mcore.process_groups import ParallelGroups
from megatron_logra.mcore.training.setup import TrainingSetup, setup_training
from megatron_logra.mcore.training.step import train_step
from megatron_logra.memory.live_tensors import LiveTensorTracker
from megatron_logra.probe_batch import supervised_probe_batch

PERSISTENT = "persistent"
"""Live storage after the warm-up step that is not a weight, adapter or gradient buffer:
optimizer state, sketches, projections, caches."""


@dataclass(frozen=True)
class StepPeak:
    """Bytes of one rank in one steady-state step.

    Attributes:
        persistent_bytes: live at the start of the step (the state between steps).
        peak_bytes: the most live at any moment of the step (the realised-KL pass included).
        peak_by_category: weights, adapters, grads, persistent, activations, temporaries at
            that moment.
        peak_in_realised_kl: whether the peak fell in the realised-KL pass after the update.
    """

    persistent_bytes: int
    peak_bytes: int
    peak_by_category: dict[str, int] = field(default_factory=dict)
    peak_in_realised_kl: bool = False


def random_microbatches(cfg: Config, groups: ParallelGroups, *, vocab_size: int,
                        seed: int) -> list[Microbatch]:
    """This DP replica's share of one global batch of random tokens (a fixed ``seed``)."""
    s, b = cfg.model.seq_length, cfg.train.micro_batch_size
    per_rank = cfg.train.global_batch_size // groups.data_size
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (per_rank * groups.data_size, s + 1),
                           generator=generator)
    mine = tokens[groups.data_rank * per_rank:(groups.data_rank + 1) * per_rank].to(groups.device)
    positions = torch.arange(s, device=groups.device).expand(b, -1)
    return [
        Microbatch(tokens=mine[i:i + b, :-1].contiguous(), labels=mine[i:i + b, 1:].contiguous(),
                   loss_mask=torch.ones(b, s, device=groups.device), position_ids=positions)
        for i in range(0, per_rank, b)
    ]


def _label_persistent(tracker: LiveTensorTracker, setup: TrainingSetup) -> None:
    params = [p for chunk in setup.model_chunks for p in chunk.parameters()]
    tracker.label(params, "weights")
    tracker.label([p for a in lora_adapters(setup.model_chunks) for p in (a.a, a.b)], "adapters")
    tracker.label((getattr(p, "main_grad", None) for p in params), "grads")
    tracker.label((p.grad for p in params), "grads")
    tracker.label_live(PERSISTENT)


def _step(cfg: Config, setup: TrainingSetup, batch: list[Microbatch],
          groups: ParallelGroups, tracker: LiveTensorTracker | None) -> bool:
    """One training step as the supervised loop runs it; returns whether the realised-KL pass
    raised the step's peak (seen when ``tracker`` is given)."""
    control = setup.kl_control
    if control is not None:
        control.set_batch(supervised_probe_batch(batch, cfg.logra.kl_control,
                                                 dp_rank=groups.data_rank))
    train_step(setup, batch, groups=groups, seq_length=cfg.model.seq_length,
               micro_batch_size=cfg.train.micro_batch_size)
    if control is None:
        return False
    before = tracker.peak_bytes if tracker is not None else 0
    control.realised()
    return tracker is not None and tracker.peak_bytes > before


def measure_step_peak(cfg: Config, groups: ParallelGroups, *, vocab_size: int,
                      data_seed: int = 20) -> StepPeak:
    """Build the run's model and optimizer from resolved ``cfg``, warm up one step, measure
    the next. ``vocab_size``: the tokenizer's (random token ids are drawn below it)."""
    if groups.device.type != "cpu":
        raise ValueError(f"measure_step_peak counts tensors on CPU; parallel.device resolved to "
                         f"{groups.device}: use torch.cuda.max_memory_allocated there")
    tracker = LiveTensorTracker()
    with tracker:
        chunks = build_model_chunks(cfg, groups, vocab_size=vocab_size)
        setup = setup_training(cfg, chunks, groups, kl_vocab_size=vocab_size)
        batch = random_microbatches(cfg, groups, vocab_size=vocab_size, seed=data_seed)
        _step(cfg, setup, batch, groups, None)
        gc.collect()
        _label_persistent(tracker, setup)
        persistent = tracker.live_bytes
        tracker.reset_peak()
        realised = _step(cfg, setup, batch, groups, tracker)
        report = tracker.report()
    return StepPeak(persistent_bytes=persistent, peak_bytes=report.peak_bytes,
                    peak_by_category=dict(report.peak_by_category),
                    peak_in_realised_kl=realised)


def as_dict(peak: StepPeak) -> dict[str, Any]:
    return {"persistent_bytes": peak.persistent_bytes, "peak_bytes": peak.peak_bytes,
            "peak_by_category": peak.peak_by_category,
            "peak_in_realised_kl": peak.peak_in_realised_kl}
