"""Wrap a model for training: dense Adam or SGD, LoRA, or LoGRA (with its KL step control).

All share the model, Megatron's DDP, Megatron's optimizer and Megatron's LR scheduler; LoGRA
only freezes its target weights before DDP is built (so they get no grad-buffer slot, no
``main_grad`` and no hook) and chains a :class:`LoGRAOptimizer` for them, built with its mode's
strategy object and, when logra.kl_control.enabled, the predicted-KL step control as its step
scale.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_logra.config import Config
from megatron_logra.logra_mode import logra_mode
from megatron_logra.mcore.kl_probe.step_control import KLStepControl
from megatron_logra.mcore.models.grad_anchor import anchor_embedding_output
from megatron_logra.mcore.models.targets import find_targets
from megatron_logra.mcore.optimizer.chained import LoGRAChainedOptimizer
from megatron_logra.mcore.optimizer.logra import LoGRAOptimizer
from megatron_logra.mcore.peft.lora import attach_lora
from megatron_logra.mcore.process_groups import ParallelGroups


@dataclass
class TrainingSetup:
    model_chunks: list[DistributedDataParallel]
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    logra: LoGRAOptimizer | None
    kl_control: KLStepControl | None = None
    """The LoGRA optimizer's step scale when logra.kl_control.enabled: the trainer gives it
    each step's probe batch and reads its metrics."""

    def step_metrics(self) -> dict[str, object]:
        """The learning-rate fields of a step's record: the scheduler's lr, or what the LoGRA
        mode reports instead (paper mode has no learning rate)."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        return self.logra.mode.step_metrics(lr) if self.logra is not None else {"lr": lr}


def megatron_optimizer_config(cfg: Config) -> MegatronOptimizerConfig:
    """Our optimizer section mapped onto Megatron's (for the native part under LoGRA too)."""
    o = cfg.optimizer
    # LoGRA's native part runs its configured optimizer; LoRA adapters train with Adam.
    kind = {"logra": cfg.logra.native_optimizer, "lora": "adam"}.get(o.name, o.name)
    return MegatronOptimizerConfig(
        optimizer=kind,
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        sgd_momentum=o.sgd_momentum,
        clip_grad=o.clip_grad,
        use_distributed_optimizer=o.use_distributed_optimizer,
        bf16=cfg.model.params_dtype == "bf16",
        params_dtype=torch.bfloat16 if cfg.model.params_dtype == "bf16" else torch.float32,
    )


def finalize_grads_with_sketches(
    model: list[torch.nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection: object | None = None,
    force_all_reduce: bool | None = False,
    *,
    logra: LoGRAOptimizer,
) -> None:
    """Megatron's ``finalize_model_grads``, then the same reduction and scaling for sketches.

    Megatron all-reduces ``num_tokens`` in place to the global count, so after its call the
    tensor holds exactly the divisor it applied to the dense gradients.
    """
    finalize_model_grads(model, num_tokens, pg_collection, force_all_reduce)
    logra.reduce_sketches(num_tokens)


def freeze_non_targets(model_chunks: list[torch.nn.Module]) -> None:
    """The paper trains only the sketched linears: freeze everything else, and anchor the
    embedding's output so that backward still reaches the sketches (grad_anchor)."""
    for chunk in model_chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
    anchor_embedding_output(model_chunks)


def setup_training(
    cfg: Config, model_chunks: list[torch.nn.Module], groups: ParallelGroups, *,
    kl_vocab_size: int | None = None,
) -> TrainingSetup:
    """DDP + optimizer (+ LoGRA chain and its KL step control) + scheduler for
    ``cfg.optimizer.name``. ``kl_vocab_size``: the tokenizer's vocabulary, over which the KL
    step control's softmax runs (needed when logra.kl_control.enabled)."""
    o = cfg.optimizer
    targets = []
    mode = logra_mode(cfg.logra) if o.name == "logra" else None
    if o.name == "lora":
        # Freezes the base model: DDP then gives grad-buffer slots (and the optimizer state)
        # to the adapters only.
        attach_lora(model_chunks, cfg.lora.targets, lora_rank=cfg.lora.lora_rank,
                    alpha=cfg.lora.alpha, groups=groups, seed=cfg.lora.seed)
    if mode is not None:
        targets = find_targets(model_chunks, cfg.logra.targets, tp_rank=groups.tp_rank)
        for target in targets:
            target.weight.requires_grad_(False)
        if not mode.trains_non_targets:
            freeze_non_targets(model_chunks)
    config = model_chunks[0].config
    ddp_chunks = [
        DistributedDataParallel(
            config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=o.use_distributed_optimizer,
            ),
            module=chunk,
            # As Megatron does: only the first chunk's grads are bucketed for overlap.
            disable_bucketing=index > 0,
        )
        for index, chunk in enumerate(model_chunks)
    ]
    opt_config = megatron_optimizer_config(cfg)
    native = get_megatron_optimizer(opt_config, ddp_chunks)
    logra = None
    kl_control = None
    optimizer: MegatronOptimizer = native
    if mode is not None:
        if cfg.logra.kl_control.enabled:
            if kl_vocab_size is None:
                raise ValueError("logra.kl_control.enabled needs the tokenizer's vocabulary "
                                 "size: pass setup_training(..., kl_vocab_size=...)")
            kl_control = KLStepControl(ddp_chunks, targets, settings=cfg.logra.kl_control,
                                       groups=groups, vocab_size=kl_vocab_size)
        logra = LoGRAOptimizer(targets, logra=cfg.logra, mode=mode, config=opt_config,
                               groups=groups, step_scale=kl_control)
        optimizer = LoGRAChainedOptimizer(native, logra)
        config.finalize_model_grads_func = functools.partial(
            finalize_grads_with_sketches, logra=logra
        )
    else:
        config.finalize_model_grads_func = finalize_model_grads
    # In optimizer steps: rl takes rl.updates_per_rollout of them per training step.
    steps = cfg.optimizer_steps
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if o.lr_warmup_steps > 0 else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_steps,
        lr_decay_steps=max(steps, o.lr_warmup_steps + 1),
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=steps,
        wd_incr_style="constant",
    )
    return TrainingSetup(
        model_chunks=ddp_chunks, optimizer=optimizer, scheduler=scheduler, logra=logra,
        kl_control=kl_control,
    )
