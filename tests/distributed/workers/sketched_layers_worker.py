"""Measure, on real Megatron-Core layers over gloo, what the sketched linears do.

Run under torchrun with 1, 2 or 4 processes; ``--tp`` and ``--sp`` pick the layout (dp follows).
Rank 0 writes a JSON of measurements to ``--out/result.json``; the pytest side asserts the
claims:

* ``sketch``: per target kind, max |S - G A^T| / max |G A^T| in float64, where S is the sketch the
  layer accumulated (row-parallel partials summed over TP) and G the dense gradient of an
  identical dense model (its weight shard's .grad), over two microbatches;
* ``input_grad``: max relative difference of the embedding gradient (sketching must not change
  any input gradient) and of the loss;
* ``no_dense_grad``: whether any target weight got a .grad or a main_grad;
* ``saved``: bytes autograd saved inside each target layer's forward (parameters excluded), for the
  sketched and the dense model, with the shapes involved;
* ``ddp``: DDP grad-buffer sizes with the targets frozen, with and without the distributed
  optimizer, and the number of target parameters inside any buffer;
* ``recompute``: per activation-recompute mode (full uniform, full block, selective), the same
  float64 two-microbatch run as ``sketch`` with recompute on: max |difference| of the sketch
  buffer, the embedding gradient and the loss from the run without recompute, how many times
  each layer's sketch was accumulated, and how many times layer 0's ``linear_qkv`` and core
  attention ran forward (twice per microbatch where they are recomputed); and for full uniform
  recompute of a dense model and of a LoRA model (everything frozen but the adapters), max
  |difference| of every trainable parameter's gradient from the run without recompute.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
import torch.distributed as dist
from harness import Case, run_worker

from megatron_logra.config import load_config
from megatron_logra.mcore.models.gpt import build_model
from megatron_logra.mcore.models.targets import find_targets
from megatron_logra.mcore.peft.lora import attach_lora
from megatron_logra.mcore.tensor_parallel.sketched_linear import LayerSketch
from megatron_logra.projection import generate_projection, projection_key
from megatron_logra.sketch_buffer import FlatSketchBuffer, SketchSlot
from tests.layouts import tp_sp
from tests.presets import NARROW, tiny_gpt

VOCAB = 100
SKETCH_RANK = 8
SEQ, MICRO_BATCH = 16, 2


def build_cfg(args, world: int):
    overrides = [
        "parallel.device=cpu", *tp_sp(args.tp, args.sp), *tiny_gpt(**NARROW, seq_length=SEQ),
        "model.activation=swiglu", "model.add_bias_linear=true", "optimizer.name=logra",
        f"train.micro_batch_size={MICRO_BATCH}",
        f"train.global_batch_size={MICRO_BATCH * world // args.tp}",
    ]
    return load_config(None, overrides).resolved(world)


def batches(groups, count: int):
    """The same two microbatches on every rank (every rank is its own DP replica here)."""
    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def attach_sketches(model, groups, dtype):
    targets = find_targets([model], ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                           tp_rank=groups.tp_rank)
    buffer = FlatSketchBuffer(
        [SketchSlot(t.layer_key, t.rows, SKETCH_RANK, t.tp_partial) for t in targets],
        device="cpu", dtype=dtype,
    )
    projections = {}
    for t in targets:
        t.weight.requires_grad_(False)
        # The full A, sliced here for the reference; the layer gets its own column range.
        full = generate_projection(projection_key(42, 0, t.layer_key), SKETCH_RANK, 0,
                                   t.in_features, "rademacher")
        projections[t.layer_key] = full
        t.module.logra_sketch = LayerSketch(t.layer_key, full[:, t.col_start:t.col_end], buffer)
    return targets, buffer, projections


def run_loss(model, data):
    total = 0.0
    for tokens, labels in data:
        positions = torch.arange(SEQ).expand(MICRO_BATCH, -1)
        loss = model(tokens, positions, None, labels=labels).sum()
        loss.backward()
        total += float(loss.detach())
    return total


def measure_sketch(cfg, groups):
    dense = build_model(cfg, groups, VOCAB).double()
    sketched = build_model(cfg, groups, VOCAB).double()
    targets, buffer, projections = attach_sketches(sketched, groups, torch.float64)
    data = batches(groups, 2)
    loss_dense = run_loss(dense, data)
    loss_sketch = run_loss(sketched, data)
    dense_targets = {t.layer_key: t for t in find_targets(
        [dense], ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], tp_rank=groups.tp_rank)}
    errors: dict[str, float] = {"column": 0.0, "row": 0.0}
    for t in targets:
        grad = dense_targets[t.layer_key].weight.grad
        expected = grad @ projections[t.layer_key][:, t.col_start:t.col_end].double().t()
        got = buffer.view(t.layer_key).clone()
        if t.tp_partial and groups.tp_size > 1:
            dist.all_reduce(expected, group=groups.tp)
            dist.all_reduce(got, group=groups.tp)
        err = float((got - expected).abs().max() / expected.abs().max())
        errors[t.parallel_kind] = max(errors[t.parallel_kind], err)
    # Count the collectives the step's sketch reduction issues, and check each one operates on
    # a slice of the flat buffer (not on per-layer tensors).
    issued: list[tuple[int, int]] = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        issued.append((tensor.data_ptr(), tensor.numel()))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        buffer.reduce_(dp_group=groups.dp, tp_group=groups.tp, tp_dp_group=groups.tp_dp,
                       tp_size=groups.tp_size)
    finally:
        dist.all_reduce = real_all_reduce
    start = buffer.data.data_ptr()
    end = start + buffer.data.numel() * buffer.data.element_size()
    reduction = {
        "num_collectives": len(issued),
        "all_on_flat_buffer": all(start <= ptr < end for ptr, _ in issued),
        "elements_reduced": sum(numel for _, numel in issued),
        "buffer_elements": buffer.data.numel(),
        "partial_elements": buffer.data.numel() - buffer.partial_start,
    }
    emb_dense = dense.embedding.word_embeddings.weight.grad
    emb_sketch = sketched.embedding.word_embeddings.weight.grad
    no_dense = {
        "any_grad": any(t.weight.grad is not None for t in targets),
        "any_main_grad": any(hasattr(t.weight, "main_grad") for t in targets),
        "num_targets": len(targets),
    }
    return {
        "sketch_rel_err": errors,
        "input_grad_rel_err": float((emb_sketch - emb_dense).abs().max() / emb_dense.abs().max()),
        "loss_rel_err": abs(loss_sketch - loss_dense) / abs(loss_dense),
        "no_dense_grad": no_dense,
        "reduction": reduction,
    }


def _unpack(tensor):
    return tensor


def measure_saved(cfg, groups):
    results: dict[str, list] = {}
    for variant in ("dense", "sketched"):
        model = build_model(cfg, groups, VOCAB)
        targets = find_targets([model], ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                               tp_rank=groups.tp_rank)
        if variant == "sketched":
            attach_sketches(model, groups, torch.float32)
        param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        records = []
        for t in targets:
            saved: list[torch.Tensor] = []

            def pack(tensor, saved=saved, param_ptrs=param_ptrs):
                if tensor.untyped_storage().data_ptr() not in param_ptrs:
                    saved.append(tensor)
                return tensor

            def pre_hook(module, args, pack=pack):
                module._saved_ctx = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
                module._saved_ctx.__enter__()

            def post_hook(module, args, output):
                module._saved_ctx.__exit__(None, None, None)

            t.module.register_forward_pre_hook(pre_hook)
            t.module.register_forward_hook(post_hook)
            records.append((t, saved))
        tokens, labels = batches(groups, 1)[0]
        positions = torch.arange(SEQ).expand(MICRO_BATCH, -1)
        model(tokens, positions, None, labels=labels).sum().backward()
        results[variant] = [
            {
                "layer_key": t.layer_key,
                "kind": t.parallel_kind,
                "bytes": sum(x.numel() * x.element_size() for x in saved),
                "shapes": [list(x.shape) for x in saved],
                "in_local": t.col_end - t.col_start,
            }
            for t, saved in records
        ]
    return results


def measure_ddp(cfg, groups):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    out = {}
    for distopt in (False, True):
        model = build_model(cfg, groups, VOCAB)
        targets = find_targets([model], ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                               tp_rank=groups.tp_rank)
        for t in targets:
            t.weight.requires_grad_(False)
        ddp = DistributedDataParallel(
            model.config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                          use_distributed_optimizer=distopt),
            module=model,
        )
        target_ids = {id(t.weight) for t in targets}
        buffer_ids = {id(p) for buffer in ddp.buffers for p in buffer.param_index_map}
        trainable_ids = {id(p) for p in model.parameters() if p.requires_grad}
        out[f"distopt_{distopt}"] = {
            "buffer_params_are_trainable_params": buffer_ids == trainable_ids,
            "targets_in_buffer": len(buffer_ids & target_ids),
            "num_targets": len(target_ids),
            "buffer_numel_unpadded": sum(b.numel_unpadded for b in ddp.buffers),
            "trainable_numel": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "target_numel": sum(t.weight.numel() for t in targets),
        }
    return out


RECOMPUTE_MODES = {
    "full_uniform": ["full", "uniform", 1],
    "full_block": ["full", "block", 1],
    "selective": ["selective", None, None],
}


def sketched_run(cfg, groups, recompute: list):
    """The float64 sketched model's two-microbatch run with ``recompute``: (sketch buffer,
    embedding gradient, loss, accumulations per layer, forwards of layer 0's modules)."""
    mode, method, num_layers = recompute
    model_cfg = dataclasses.replace(cfg.model, recompute=mode, recompute_method=method,
                                    recompute_num_layers=num_layers)
    model = build_model(dataclasses.replace(cfg, model=model_cfg), groups, VOCAB).double()
    _, buffer, _ = attach_sketches(model, groups, torch.float64)
    accumulations: Counter[str] = Counter()
    accumulate = buffer.accumulate_

    def counting_accumulate(layer_key, *args):
        accumulations[layer_key] += 1
        return accumulate(layer_key, *args)

    buffer.accumulate_ = counting_accumulate
    forwards: Counter[str] = Counter()
    attention = model.decoder.layers[0].self_attention
    for name in ("linear_qkv", "core_attention"):
        getattr(attention, name).register_forward_hook(
            lambda *_, name=name: forwards.update([name]))
    loss = run_loss(model, batches(groups, 2))
    return (buffer.data.clone(), model.embedding.word_embeddings.weight.grad, loss,
            accumulations, dict(forwards))


def trainable_grads(cfg, groups, recompute: list, method: str) -> list[torch.Tensor]:
    """Gradients of every trainable parameter after the two-microbatch float64 run of a dense
    (``method="dense"``) or LoRA model with ``recompute``."""
    mode, recompute_method, num_layers = recompute
    model_cfg = dataclasses.replace(cfg.model, recompute=mode, recompute_method=recompute_method,
                                    recompute_num_layers=num_layers)
    model = build_model(dataclasses.replace(cfg, model=model_cfg), groups, VOCAB).double()
    if method == "lora":
        adapters = attach_lora([model], ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                               lora_rank=4, alpha=8.0, groups=groups, seed=1)
        with torch.no_grad():  # B starts at zero; a nonzero B gives A a gradient too
            for adapter in adapters:
                adapter.b.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(9))
    run_loss(model, batches(groups, 2))
    return [p.grad for p in model.parameters() if p.requires_grad]


def measure_recompute(cfg, groups):
    sketch, embedding_grad, loss, _, forwards = sketched_run(cfg, groups, ["none", None, None])
    out = {"none": {"forwards": forwards}}
    for name, recompute in RECOMPUTE_MODES.items():
        got_sketch, got_grad, got_loss, accumulations, forwards = sketched_run(
            cfg, groups, recompute)
        out[name] = {
            "sketch_max_abs_diff": float((got_sketch - sketch).abs().max()),
            "embedding_grad_max_abs_diff": float((got_grad - embedding_grad).abs().max()),
            "loss_abs_diff": abs(got_loss - loss),
            "accumulations_per_layer": sorted(set(accumulations.values())),
            "layers": len(accumulations),
            "forwards": forwards,
        }
    for method in ("dense", "lora"):
        want = trainable_grads(cfg, groups, ["none", None, None], method)
        got = trainable_grads(cfg, groups, RECOMPUTE_MODES["full_uniform"], method)
        out[f"{method}_full_uniform"] = {
            "num_grads": sum(g is not None for g in got),
            "num_trainable": len(got),
            "grad_max_abs_diff": max(float((a - b).abs().max()) for a, b in
                                     zip(got, want, strict=True)),
        }
    return out


def measure(args, cfg, groups):
    return {
        "recompute": measure_recompute(cfg, groups),
        "layout": {"tp": groups.tp_size, "dp": groups.dp_size, "sp": args.sp,
                   "tokens": SEQ * MICRO_BATCH, "sketch_rank": SKETCH_RANK},
        "sketch": measure_sketch(cfg, groups),
        "saved": measure_saved(cfg, groups),
        "ddp": measure_ddp(cfg, groups),
    }


def add_arguments(parser) -> None:
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--sp", action="store_true")


if __name__ == "__main__":
    run_worker({"sketched_layers": Case(build_cfg, measure)}, add_arguments)
