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

if TYPE_CHECKING:  # only for the annotation
    from megatron_logra.config import Config


def master_weights(cfg: Config) -> str:
    """The config's ``logra.master_weights``, ``auto`` resolved as the trainer resolves it."""
    if cfg.logra.master_weights != "auto":
        return cfg.logra.master_weights
    return "dp_sharded" if cfg.model.params_dtype == "bf16" else "none"


def layout_of(cfg: Config) -> Layout:
    """The layout and per-step batch of one GPU of a resolved ``cfg``."""
    p, m = cfg.parallel, cfg.model
    dp = p.dp or 1
    full = m.full_recompute
    return Layout(
        tp=p.tp, cp=p.cp, cpu=p.device == "cpu", pp=p.pp, vpp=p.vpp, dp=dp, ep=p.ep,
        micro_batch_size=cfg.train.micro_batch_size,
        seq_length=m.seq_length, sequence_parallel=p.sp, recompute=m.recompute,
        num_microbatches=max(1, cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)),
        attention=m.attention, recompute_num_layers=full[1] if full else 1,
    )


def kl_probe_of(cfg: Config) -> KLProbe | None:
    """The KL probe of a supervised step on one DP rank (the batch's first sequences)."""
    kl = cfg.logra.kl_control
    if cfg.optimizer.name != "logra" or not kl.enabled:
        return None
    dp = cfg.parallel.dp or 1
    per_rank = cfg.train.global_batch_size // dp
    # DP rank 0 holds the most probe sequences: the first ones of the global batch.
    return KLProbe(sequences=min(kl.probe_responses, per_rank),
                   tokens_per_sequence=min(kl.probe_max_tokens, cfg.model.seq_length))


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
