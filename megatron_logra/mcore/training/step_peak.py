"""Peak live tensor storage of one steady-state training step of the model the product builds.

What ``megatron-logra train`` does per step, counted by
:class:`megatron_logra.memory.live_tensors.LiveTensorTracker`: the run's own model, DDP and
optimizer (``setup_training``), one global batch of random tokens, and -- with
``logra.kl_control.enabled`` -- the probe batch of a supervised step and the realised-KL pass
after the update, as the supervised loop runs them; with ``train.packing`` the batch's
sequences packed whole into token-budget rows, as the supervised trainer packs prompt data. A warm-up step first allocates the
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
from megatron_logra.packing import RowLayout, pack_row, plan_packs
from megatron_logra.packing.plan import layout_multiples
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
        peak_in_kl_probe: whether the peak fell in the KL probe's forward-mode pass (the step
            scale's call inside the optimizer's step).
        kl_probe_bytes: the most live during the KL step control's two passes (the predicted
            and the realised KL) beyond the persistent state -- the estimate's
            ``after_backward`` (0 without KL control).
    """

    persistent_bytes: int
    peak_bytes: int
    peak_by_category: dict[str, int] = field(default_factory=dict)
    peak_in_realised_kl: bool = False
    peak_in_kl_probe: bool = False
    kl_probe_bytes: int = 0


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


def packed_rows(cfg: Config, microbatches: list[Microbatch]) -> list[Microbatch]:
    """The sequences of ``microbatches`` (every token counted) packed whole into rows of
    ``train.packing.max_tokens_per_microbatch`` tokens, as the supervised trainer packs its
    prompt data (one rank's: the plan is over this rank's sequences)."""
    p = cfg.parallel
    tokens = [row for batch in microbatches for row in batch.tokens]
    labels = [row for batch in microbatches for row in batch.labels]
    sequence_multiple, row_multiple = layout_multiples(p.tp, p.sp, p.cp)
    plan = plan_packs([len(row) for row in tokens],
                      max_tokens=cfg.train.packing.max_tokens_per_microbatch, dp_size=1,
                      algorithm=cfg.train.packing.algorithm, sequence_multiple=sequence_multiple,
                      row_multiple=row_multiple,
                      uniform_rows=p.pp > 1)
    device = microbatches[0].tokens.device
    rows = []
    for pack in plan.ranks[0]:
        layout = RowLayout.of(pack)
        rows.append(Microbatch(
            tokens=pack_row([tokens[i] for i in pack.indices], layout, 0).to(device),
            labels=pack_row([labels[i] for i in pack.indices], layout, 0).to(device),
            loss_mask=pack_row([torch.ones(len(tokens[i])) for i in pack.indices], layout,
                               0.0, dtype=torch.float32).to(device),
            position_ids=layout.position_ids().to(device), layout=layout,
        ))
    return rows


def _label_persistent(tracker: LiveTensorTracker, setup: TrainingSetup) -> None:
    params = [p for chunk in setup.model_chunks for p in chunk.parameters()]
    tracker.label(params, "weights")
    tracker.label([p for a in lora_adapters(setup.model_chunks) for p in (a.a, a.b)], "adapters")
    tracker.label((getattr(p, "main_grad", None) for p in params), "grads")
    tracker.label((p.grad for p in params), "grads")
    tracker.label_live(PERSISTENT)


class _PeakWatch:
    """The step scale, watched: whether the tracker's peak rose during its call."""

    def __init__(self, inner: Any, tracker: LiveTensorTracker) -> None:
        self.inner, self.tracker = inner, tracker
        self.raised, self.peak_after, self.span_peak = False, 0, 0

    def __call__(self, proposal: Any) -> float:
        before = self.tracker.peak_bytes
        with self.tracker.span() as span:
            alpha = self.inner(proposal)
        self.span_peak = span.peak_bytes
        self.peak_after = self.tracker.peak_bytes
        self.raised = self.peak_after > before
        return alpha

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def _step(cfg: Config, setup: TrainingSetup, batch: list[Microbatch],
          groups: ParallelGroups, tracker: LiveTensorTracker | None) -> tuple[bool, bool, int]:
    """One training step as the supervised loop runs it; returns whether the KL probe's
    forward-mode pass and whether the realised-KL pass set the step's peak, and the most live
    during those two passes (seen when ``tracker`` is given)."""
    control = setup.kl_control
    if control is not None:
        control.set_batch(supervised_probe_batch(batch, cfg.logra.kl_control,
                                                 dp_rank=groups.data_rank,
                                                 dp_size=groups.data_size))
    watch = None
    if control is not None and tracker is not None:
        watch = _PeakWatch(setup.logra.step_scale, tracker)
        setup.logra.step_scale = watch
    try:
        if cfg.train.packing.enabled:
            rows = packed_rows(cfg, batch)
            train_step(setup, rows, groups=groups,
                       seq_length=max(r.tokens.shape[1] for r in rows), micro_batch_size=1)
        else:
            train_step(setup, batch, groups=groups, seq_length=cfg.model.seq_length,
                       micro_batch_size=cfg.train.micro_batch_size)
    finally:
        if watch is not None:
            setup.logra.step_scale = watch.inner
    if control is None:
        return False, False, 0
    if tracker is None:
        control.realised()
        return False, False, 0
    before = tracker.peak_bytes
    with tracker.span() as span:
        control.realised()
    realised = tracker.peak_bytes > before
    probe = watch.raised and tracker.peak_bytes == watch.peak_after
    return probe, realised, max(watch.span_peak, span.peak_bytes)


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
        probe, realised, probe_peak = _step(cfg, setup, batch, groups, tracker)
        report = tracker.report()
    return StepPeak(persistent_bytes=persistent, peak_bytes=report.peak_bytes,
                    peak_by_category=dict(report.peak_by_category),
                    peak_in_realised_kl=realised, peak_in_kl_probe=probe,
                    kl_probe_bytes=max(0, probe_peak - persistent) if probe_peak else 0)


def as_dict(peak: StepPeak) -> dict[str, Any]:
    return {"persistent_bytes": peak.persistent_bytes, "peak_bytes": peak.peak_bytes,
            "peak_by_category": peak.peak_by_category,
            "peak_in_realised_kl": peak.peak_in_realised_kl,
            "peak_in_kl_probe": peak.peak_in_kl_probe, "kl_probe_bytes": peak.kl_probe_bytes}
