"""The estimate of the run a config describes: its model, layout, method and step (no torch).

One place that maps a run's config to the estimator's inputs, so the tools and the checks
against measurement (tools/estimate_vs_measured.py) estimate exactly what the trainer builds:
``model.attention`` and ``model.recompute``, the method of ``optimizer.name`` (LoGRA's mode,
master weights and KL probe included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_logra.memory.estimate import (
    KLProbe,
    MemoryBreakdown,
    dense_adam_memory,
    logra_memory,
    lora_memory,
)
from megatron_logra.memory.shapes import (
    LOGRA_PRECISION_OF_MASTER_WEIGHTS,
    Layout,
    shape_from_model_config,
)
from megatron_logra.probe_selection import probe_indices

if TYPE_CHECKING:  # only for the annotation
    from megatron_logra.config import Config


def master_weights(cfg: Config) -> str:
    """The config's ``logra.master_weights``, ``auto`` resolved as the trainer resolves it."""
    if cfg.logra.master_weights != "auto":
        return cfg.logra.master_weights
    return "dp_sharded" if cfg.model.params_dtype == "bf16" else "none"


def layout_of(cfg: Config) -> Layout:
    """The layout and per-step batch of one GPU of a resolved ``cfg``: with train.packing, one
    row of the token budget per microbatch, holding sequences of at most ``model.seq_length``
    (microbatches counted as if every sequence were that long: the most a step can need)."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    dp = p.dp or 1
    full = m.full_recompute
    batch: dict[str, int | None] = {
        "micro_batch_size": t.micro_batch_size, "seq_length": m.seq_length,
        "num_microbatches": max(1, t.global_batch_size // (t.micro_batch_size * dp)),
    }
    if t.packing.enabled:
        budget = t.packing.max_tokens_per_microbatch
        batch = {"micro_batch_size": 1, "seq_length": budget,
                 "attention_span": min(m.seq_length, budget),
                 "num_microbatches": max(1, -(-t.global_batch_size * m.seq_length
                                              // (budget * dp)))}
    return Layout(
        tp=p.tp, cp=p.cp, cpu=p.device == "cpu", pp=p.pp, vpp=p.vpp, dp=dp, ep=p.ep,
        sequence_parallel=p.sp, recompute=m.recompute, attention=m.attention,
        recompute_num_layers=full[1] if full else 1, **batch,
    )


def kl_probe_of(cfg: Config) -> KLProbe | None:
    """The KL probe of a supervised step on the DP rank holding the most of its evenly spaced
    sequences, each a piece of at most ``probe_max_tokens`` counted positions; library mode
    trains the output layer, whose weight the realised KL then keeps a copy of."""
    kl = cfg.logra.kl_control
    if cfg.optimizer.name != "logra" or not kl.enabled:
        return None
    dp = cfg.parallel.dp or 1
    per_rank = cfg.train.global_batch_size // dp
    # The rank holding the most of the evenly spaced probe sequences.
    chosen = probe_indices(cfg.train.global_batch_size, kl.probe_responses)
    most = max(sum(1 for i in chosen if i // per_rank == rank) for rank in range(dp))
    return KLProbe(sequences=most,
                   tokens_per_sequence=min(kl.probe_max_tokens, cfg.model.seq_length),
                   output_trains=cfg.logra.mode != "paper")


def estimate_for_config(cfg: Config, *, vocab_size: int) -> MemoryBreakdown:
    """Per-GPU bytes of the first pipeline stage of the run ``cfg`` (resolved) describes;
    ``vocab_size`` is the tokenizer's (the model pads it)."""
    shape = shape_from_model_config(cfg.model, vocab_size=vocab_size, name="config")
    layout = layout_of(cfg)
    o = cfg.optimizer
    precision = cfg.model.params_dtype
    if o.name == "lora":
        return lora_memory(shape, layout, lora_rank=cfg.lora.lora_rank, precision=precision,
                           distributed_optimizer=o.use_distributed_optimizer,
                           targets=tuple(cfg.lora.targets))
    if o.name == "logra":
        paper = cfg.logra.mode == "paper"
        return logra_memory(
            shape, layout, sketch_rank=cfg.logra.sketch_rank,
            precision=LOGRA_PRECISION_OF_MASTER_WEIGHTS[master_weights(cfg)],
            distributed_optimizer=o.use_distributed_optimizer,
            non_targets="frozen" if paper else "adam", targets=tuple(cfg.logra.targets),
            paper_mode=paper, kl_probe=kl_probe_of(cfg),
        )
    return dense_adam_memory(shape, layout, precision=precision,
                             distributed_optimizer=o.use_distributed_optimizer)
