"""How tools/bench_methods.py configures, builds, steps and estimates one method.

A method key is ``dense_adam``, ``lora``, ``logra`` (library mode) or ``logra_paper`` (paper mode
with the predicted-KL step control), optionally ``@<logra.master_weights>``. Every flag of the
benchmark becomes the config key that owns it (``--recompute`` -> ``model.recompute``,
``--attention`` -> ``model.attention``, ``--dtype`` -> ``model.params_dtype``,
``--master-weights`` -> ``logra.master_weights``); the config checks them.
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

import torch
from bench_methods_report import is_logra

METHODS = ("dense_adam", "lora", "logra", "logra_paper")
OPTIMIZER_NAMES = {"dense_adam": "adam", "lora": "lora", "logra": "logra", "logra_paper": "logra"}
DATA_SEED = 20
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.\d+$")
LORA_SEED = 7


def master_mode(args: argparse.Namespace, key: str) -> str | None:
    """The logra.master_weights a LoGRA method key runs with (None: the config's default)."""
    _, _, mode = key.partition("@")
    return mode or args.master_weights or None


def lora_rank(args: argparse.Namespace) -> int:
    return args.lora_rank or args.sketch_rank


def lora_alpha(args: argparse.Namespace) -> float:
    return args.lora_alpha if args.lora_alpha is not None else 2.0 * lora_rank(args)


def method_config(args: argparse.Namespace, key: str, world: int) -> Any:
    from megatron_logra.config import load_config

    method = key.partition("@")[0]
    dp = world // args.tp
    overrides = [
        f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
        f"model.num_attention_heads={args.heads}", f"model.ffn_hidden_size={args.ffn}",
        f"model.seq_length={args.seq_length}", "model.activation=swiglu",
        "model.normalization=RMSNorm", "model.add_bias_linear=false",
        f"parallel.tp={args.tp}", f"parallel.sp={str(args.sp).lower()}",
        f"parallel.device={args.device}",
        f"optimizer.name={OPTIMIZER_NAMES[method]}", f"optimizer.lr={args.lr}",
        f"lora.lora_rank={lora_rank(args)}", f"lora.alpha={lora_alpha(args)}", f"lora.seed={LORA_SEED}",
        "optimizer.clip_grad=1.0", f"logra.sketch_rank={args.sketch_rank}",
        f"train.micro_batch_size={args.micro_batch_size}",
        f"train.global_batch_size={args.micro_batch_size * args.microbatches * dp}",
        f"train.steps={args.warmup + args.steps + 1}",
        f"model.recompute={args.recompute}", f"model.attention={args.attention}",
        f"model.params_dtype={args.dtype}",
    ]
    if args.moe_experts:
        overrides += [f"model.num_moe_experts={args.moe_experts}",
                      f"model.moe_router_topk={args.moe_topk}", f"parallel.ep={args.ep}"]
        if args.moe_ffn:
            overrides.append(f"model.moe_ffn_hidden_size={args.moe_ffn}")
        if args.moe_shared_ffn:
            overrides.append(f"model.moe_shared_expert_ffn_hidden_size={args.moe_shared_ffn}")
    mode = master_mode(args, key) if is_logra(key) else None
    if mode is not None:
        overrides.append(f"logra.master_weights={mode}")
    if method == "logra_paper":
        overrides += ["logra.mode=paper", "logra.kl_control.enabled=true"]
    return load_config(None, overrides).resolved(world)


def microbatches(args: argparse.Namespace, groups: Any, device: torch.device) -> list[Any]:
    """This DP rank's share of one fixed global batch of random tokens (the same for every
    method and layout)."""
    from megatron_logra.data.lm_batches import Microbatch

    generator = torch.Generator().manual_seed(DATA_SEED)
    per_rank = args.micro_batch_size * args.microbatches
    tokens = torch.randint(0, args.vocab, (per_rank * groups.dp_size, args.seq_length + 1),
                           generator=generator)
    mine = tokens[groups.dp_rank * per_rank:(groups.dp_rank + 1) * per_rank].to(device)
    positions = torch.arange(args.seq_length, device=device).expand(args.micro_batch_size, -1)
    out = []
    for start in range(0, per_rank, args.micro_batch_size):
        window = mine[start:start + args.micro_batch_size]
        out.append(Microbatch(tokens=window[:, :-1].contiguous(),
                              labels=window[:, 1:].contiguous(),
                              loss_mask=torch.ones(window.shape[0], args.seq_length,
                                                   device=device),
                              position_ids=positions))
    return out


def resolved_master_mode(cfg: Any) -> str:
    """logra.master_weights as the optimizer resolves ``auto`` (none for fp32, dp_sharded for
    bf16: megatron_logra.master_weights.master_weights_mode)."""
    if cfg.logra.master_weights != "auto":
        return cfg.logra.master_weights
    return "none" if cfg.model.params_dtype == "fp32" else "dp_sharded"


def estimate(args: argparse.Namespace, cfg: Any, key: str) -> dict[str, float]:
    """The estimator's figures for the run this method's config describes: the model the product
    builds (attention kind, recompute mode, paper mode's norms and KL probe), the same function
    ``tools/memory_estimator.py --as-built`` and ``tools/estimate_vs_measured.py`` use."""
    from megatron_logra.memory.from_config import estimate_for_config

    del key  # the config says the method
    est = estimate_for_config(cfg, vocab_size=args.vocab)
    return {"persistent_bytes": est.persistent, "activations_bytes": est.activations,
            "total_bytes": est.total, "host_bytes": est.host_optimizer_state}


def build(args: argparse.Namespace, key: str, groups: Any) -> tuple[Any, Any]:
    """The method's config and TrainingSetup on a freshly built model (the same initial weights
    for all)."""
    from megatron_logra.mcore.models.gpt import build_model_chunks
    from megatron_logra.mcore.training.setup import setup_training

    cfg = method_config(args, key, groups.world_size)
    chunks = build_model_chunks(cfg, groups, vocab_size=args.vocab)
    return cfg, setup_training(cfg, chunks, groups, kl_vocab_size=args.vocab)


class _TimedStepScale:
    """The KL step control, timed: its call is the probe's forward-mode JVP and predicted KL
    (collective), which the LoGRA optimizer runs inside ``step()``."""

    def __init__(self, inner: Any, device: torch.device) -> None:
        self.inner, self.device, self.seconds = inner, device, 0.0

    def __call__(self, proposal: Any) -> float:
        start = time.perf_counter()
        alpha = self.inner(proposal)
        _sync(self.device)
        self.seconds = time.perf_counter() - start
        return alpha

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def stepper(args: argparse.Namespace, cfg: Any, setup: Any, groups: Any) -> Any:
    """One training step as ``train``/``rl`` take it (with KL control: the probe batch set before,
    the realised KL measured after); returns the loss and the timed parts of the step."""
    from megatron_logra.mcore.training.step import train_step
    from megatron_logra.probe_batch import supervised_probe_batch

    batch = microbatches(args, groups, groups.device)
    control = setup.kl_control
    timed = None
    if control is not None:
        timed = _TimedStepScale(control, groups.device)
        setup.logra.step_scale = timed

    def step() -> tuple[float, dict[str, float]]:
        parts: dict[str, float] = {}
        if control is not None:
            control.set_batch(supervised_probe_batch(batch, cfg.logra.kl_control,
                                                     dp_rank=groups.dp_rank, dp_size=groups.dp_size))
        result = train_step(setup, batch, groups=groups, seq_length=args.seq_length,
                            micro_batch_size=args.micro_batch_size)
        _sync(groups.device)
        if control is not None:
            start = time.perf_counter()
            control.realised()
            _sync(groups.device)
            parts["kl_realised"] = time.perf_counter() - start
            parts["kl_probe"] = timed.seconds
        if setup.logra is not None and setup.logra.last_merge_time_s is not None:
            parts["merge"] = setup.logra.last_merge_time_s
        return result.loss, parts

    return step


def built_settings(cfg: Any, setup: Any) -> dict[str, Any]:
    """What the built model and optimizer run, read back from them (not from the flags)."""
    chunk = setup.model_chunks[0]
    core = [type(m).__name__ for n, m in chunk.named_modules() if n.endswith("core_attention")]
    # Routed experts as built on this rank: the MLPs in Megatron's SequentialMLP containers.
    experts = [n for n, _ in chunk.named_modules() if _LOCAL_EXPERT.search(n)]
    stores = sorted({type(m).__name__ for m in setup.logra.masters.values()}) if setup.logra else []
    return {
        "params_dtype": cfg.model.params_dtype, "attention": cfg.model.attention,
        "recompute": cfg.model.recompute,
        "master_weights": resolved_master_mode(cfg) if setup.logra is not None else None,
        "weight_dtype": str(next(chunk.parameters()).dtype),
        "recompute_granularity": chunk.config.recompute_granularity,
        "core_attention": sorted(set(core)), "master_stores": stores,
        "kl_control": setup.kl_control is not None,
        "num_moe_experts": cfg.model.num_moe_experts, "local_experts": len(experts),
    }
