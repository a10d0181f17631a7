"""Measure LoRA adapters on real Megatron-Core layers over gloo, for tests/distributed/test_lora.py.

Run under torchrun; ``--tp`` and ``--sp`` pick the layout (dp = 1). ``--case measure``: rank 0
writes into ``--out``:

* ``result.json``:
  * ``init``: whether the LoRA model at initialisation (B = 0) gives bitwise the base model's
    per-token losses and logits;
  * ``fp64``: float64, with B set to layout-independent nonzero values: the LoRA loss vs the
    loss of a dense model with merged weights ``W + scale * B A``, and the adapter gradients
    (through Megatron's DDP and ``finalize_model_grads``) vs the chain rule from that merged
    model's dense weight gradient G: ``dB = scale * G A^T``, ``dA = scale * B^T G``;
  * ``train``: fp32 LoRA training through ``setup_training`` with ``optimizer.name=lora`` (Megatron DDP + Adam): losses
    and grad norms per step, and whether any base parameter changed or got a gradient;
* ``grads.pt``: the full (TP-gathered) float64 adapter gradients, keyed ``<layer_key>.a/.b``;
* ``adapters.pt``: the full fp32 adapters after training;
* ``ckpt/``: with ``--save``, a checkpoint of the trained LoRA setup.

``--case load --checkpoint CKPT``: the worker instead builds the LoRA setup, loads the checkpoint
(any layout) and writes the loaded full adapters to ``loaded.pt``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from harness import Case, run_worker
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
)
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_logra.config import TARGET_NAMES, load_config
from megatron_logra.data.lm_batches import Microbatch
from megatron_logra.mcore.checkpointing.checkpoint import load_checkpoint, save_checkpoint
from megatron_logra.mcore.models.gpt import build_model
from megatron_logra.mcore.models.sharding import (
    gather_full,
    global_named_parameters,
    partition_of,
    shard_from_full,
)
from megatron_logra.mcore.models.targets import find_targets
from megatron_logra.mcore.peft.lora import attach_lora, lora_adapters
from megatron_logra.mcore.training.setup import setup_training
from megatron_logra.mcore.training.step import train_step
from tests.layouts import tp_sp
from tests.presets import NARROW, tiny_gpt

VOCAB = 100
SEQ, MICRO_BATCH = 16, 2
LORA_RANK, ALPHA, LORA_SEED = 4, 8.0, 3
TRAIN_STEPS = 4


def build_cfg(args, world: int, lora_seed: int = LORA_SEED):
    overrides = [
        "parallel.device=cpu", *tp_sp(args.tp, args.sp), *tiny_gpt(**NARROW, seq_length=SEQ),
        "model.activation=swiglu", "model.add_bias_linear=true", "optimizer.name=lora",
        f"lora.lora_rank={LORA_RANK}", f"lora.alpha={ALPHA}", f"lora.seed={lora_seed}",
        "optimizer.lr=0.01", "optimizer.clip_grad=1.0", f"train.steps={TRAIN_STEPS}",
        f"train.micro_batch_size={MICRO_BATCH}", f"train.global_batch_size={MICRO_BATCH}",
    ]
    return load_config(None, overrides).resolved(world)


def microbatch(seed: int) -> Microbatch:
    """The same microbatch on every rank (every layout here has one data-parallel replica)."""
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(seed))
    return Microbatch(tokens=tokens[:, :-1], labels=tokens[:, 1:],
                      loss_mask=torch.ones(MICRO_BATCH, SEQ),
                      position_ids=torch.arange(SEQ).expand(MICRO_BATCH, -1))


def per_token_loss(model, batch: Microbatch) -> torch.Tensor:
    return model(batch.tokens, batch.position_ids, None, labels=batch.labels)


def fp64_loss(model, batch: Microbatch) -> torch.Tensor:
    """Summed cross entropy computed in float64 from the gathered logits (Megatron's own loss
    casts the logits to fp32, which would hide float64 agreement across layouts)."""
    logits = gather_from_tensor_model_parallel_region(
        model(batch.tokens, batch.position_ids, None))
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1), reduction="sum")


def full_adapter_tensors(adapters, groups, *, grads: bool) -> dict[str, torch.Tensor]:
    out = {}
    for adapter in adapters:
        for name in ("a", "b"):
            param = getattr(adapter, name)
            value = param.main_grad if grads else param.detach()
            carrier = value.detach().clone()
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                setattr(carrier, attr, getattr(param, attr))
            out[f"{adapter.layer_key}.{name}"] = gather_full(carrier, groups.tp, groups.tp_size)
    return out


def measure_init(cfg, groups) -> dict:
    base = build_model(cfg, groups, VOCAB)
    lora = build_model(cfg, groups, VOCAB)
    attach_lora([lora], TARGET_NAMES, lora_rank=LORA_RANK, alpha=ALPHA, groups=groups,
                seed=LORA_SEED)
    batch = microbatch(11)
    loss_base, loss_lora = per_token_loss(base, batch), per_token_loss(lora, batch)
    logits_base = base(batch.tokens, batch.position_ids, None)
    logits_lora = lora(batch.tokens, batch.position_ids, None)
    rejected = {}
    for label, kwargs in (("lora_rank", {"lora_rank": 0, "alpha": ALPHA}),
                          ("alpha", {"lora_rank": LORA_RANK, "alpha": -1.0}),
                          ("twice", {"lora_rank": LORA_RANK, "alpha": ALPHA})):
        try:
            attach_lora([lora], TARGET_NAMES, groups=groups, seed=LORA_SEED, **kwargs)
        except ValueError as error:
            rejected[label] = str(error)
    return {
        "rejected": rejected,
        "losses_bitwise_equal": bool(torch.equal(loss_base, loss_lora)),
        "logits_bitwise_equal": bool(torch.equal(logits_base, logits_lora)),
        "num_adapters": len(lora_adapters([lora])),
    }


def _random_full(layer_key: str, shape: tuple[int, ...]) -> torch.Tensor:
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(layer_key))
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64) * 0.1


def measure_fp64(cfg, groups, out_dir: Path) -> dict:
    lora = build_model(cfg, groups, VOCAB).double()
    adapters = attach_lora([lora], TARGET_NAMES, lora_rank=LORA_RANK, alpha=ALPHA,
                           groups=groups, seed=LORA_SEED)
    # B = 0 makes dA vanish; give every B a layout-independent nonzero value.
    with torch.no_grad():
        for adapter in adapters:
            dim, stride = partition_of(adapter.b)
            rows = adapter.b.shape[0] * (groups.tp_size if dim == 0 else 1)
            full = _random_full(adapter.layer_key, (rows, LORA_RANK))
            adapter.b.copy_(shard_from_full(full, dim, stride, groups.tp_rank, groups.tp_size))
    ddp = DistributedDataParallel(
        lora.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False),
        module=lora,
    )
    batch = microbatch(12)
    loss_lora = fp64_loss(ddp, batch)
    loss_lora.backward()
    finalize_model_grads([ddp], None)
    grads = full_adapter_tensors(adapters, groups, grads=True)

    # The reference: the same base model with the adapters merged into its weights.
    merged = build_model(cfg, groups, VOCAB).double()
    targets = {t.layer_key: t for t in find_targets([merged], TARGET_NAMES,
                                                    tp_rank=groups.tp_rank)}
    full_factors = full_adapter_tensors(adapters, groups, grads=False)
    with torch.no_grad():
        for adapter in adapters:
            delta = adapter.scale * adapter.b @ adapter.a
            targets[adapter.layer_key].weight.add_(delta)
    loss_merged = fp64_loss(merged, batch)
    loss_merged.backward()
    loss_base = fp64_loss(build_model(cfg, groups, VOCAB).double(), batch)
    errors = {"a": 0.0, "b": 0.0}
    for adapter in adapters:
        weight = targets[adapter.layer_key].weight
        carrier = weight.grad.detach().clone()
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            setattr(carrier, attr, getattr(weight, attr))
        dense_grad = gather_full(carrier, groups.tp, groups.tp_size)
        full_a = full_factors[f"{adapter.layer_key}.a"]
        full_b = full_factors[f"{adapter.layer_key}.b"]
        expected = {"a": adapter.scale * full_b.t() @ dense_grad,
                    "b": adapter.scale * dense_grad @ full_a.t()}
        for name, want in expected.items():
            got = grads[f"{adapter.layer_key}.{name}"]
            errors[name] = max(errors[name], float((got - want).abs().max() / want.abs().max()))
    if groups.world_rank == 0:
        torch.save(grads, out_dir / "grads.pt")
    return {
        "loss_rel_err": abs(float(loss_lora) - float(loss_merged)) / abs(float(loss_merged)),
        # How far the adapters move the loss: the comparison above is not vacuous.
        "adapter_loss_effect": abs(float(loss_lora) - float(loss_base)) / abs(float(loss_base)),
        "grad_rel_err": errors,
        "min_grad_abs_max": min(float(g.abs().max()) for g in grads.values()),
    }


def _full_base_weights(model, groups) -> dict[str, torch.Tensor]:
    return {name: gather_full(p, groups.tp, groups.tp_size)
            for name, p in global_named_parameters(model) if ".lora." not in name}


def measure_training(cfg, groups, out_dir: Path, save: bool) -> dict:
    model = build_model(cfg, groups, VOCAB)
    before = _full_base_weights(model, groups)
    setup = setup_training(cfg, [model], groups)
    losses, grad_norms = [], []
    for step in range(TRAIN_STEPS):
        result = train_step(setup, [microbatch(100 + step)], groups=groups, seq_length=SEQ,
                            micro_batch_size=MICRO_BATCH)
        losses.append(result.loss)
        grad_norms.append(result.grad_norm)
    after = _full_base_weights(model, groups)
    adapters = lora_adapters(setup.model_chunks)
    base_params = [p for name, p in global_named_parameters(model) if ".lora." not in name]
    full = full_adapter_tensors(adapters, groups, grads=False)
    if groups.world_rank == 0:
        torch.save(full, out_dir / "adapters.pt")
    if save:
        save_checkpoint(out_dir / "ckpt", step=TRAIN_STEPS, setup=setup, cfg=cfg, groups=groups)
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "base_unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "num_base_params": len(before),
        "base_any_requires_grad": any(p.requires_grad for p in base_params),
        "base_any_grad": any(p.grad is not None for p in base_params),
        "base_any_main_grad": any(hasattr(p, "main_grad") for p in base_params),
        "trainable_are_adapters": {id(p) for p in model.parameters() if p.requires_grad}
        == {id(p) for a in adapters for p in (a.a, a.b)},
        "b_abs_max_after": min(float(full[f"{a.layer_key}.b"].abs().max()) for a in adapters),
    }


def load_trained(args, cfg, groups) -> None:
    if args.checkpoint is None:
        raise ValueError("--case load needs --checkpoint")
    model = build_model(cfg, groups, VOCAB)
    # Another adapter seed: A and B must both come from the checkpoint.
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, seed=LORA_SEED + 1))
    setup = setup_training(cfg, [model], groups)
    load_checkpoint(args.checkpoint, setup=setup, cfg=cfg, groups=groups)
    full = full_adapter_tensors(lora_adapters(setup.model_chunks), groups, grads=False)
    if groups.world_rank == 0:
        torch.save(full, args.out / "loaded.pt")


def measure(args, cfg, groups) -> dict:
    return {
        "layout": {"tp": groups.tp_size, "sp": args.sp},
        "init": measure_init(cfg, groups),
        "fp64": measure_fp64(cfg, groups, args.out),
        "train": measure_training(cfg, groups, args.out, args.save),
    }


def add_arguments(parser) -> None:
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--checkpoint", type=Path)


if __name__ == "__main__":
    run_worker({"measure": Case(build_cfg, measure), "load": Case(build_cfg, load_trained)},
               add_arguments)
