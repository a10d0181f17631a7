"""Measure context parallelism on real Megatron-Core GPTs over gloo, against CP=1.

One 4-process job runs every layout in turn (``switch_layout`` keeps the process group): each
context-parallel layout is measured beside a CP=1 layout with the same TP size, so every rank's
tensors (vocabulary shards, sketch rows) compare directly:

* ``tp2_cp2`` (TP=2 with sequence parallelism, CP=2) beside ``tp2_dp2`` (TP=2 with SP, DP=2);
* ``cp2_dp2`` (CP=2, DP=2) beside ``dp4`` (DP=4).

The global batch is the same four sequences everywhere: a rank takes its data-parallel replica's
sequences and, under CP, its two chunks of each (``megatron_logra.context_parallel``). Rank 0
writes, per layout, in float64 (a narrow GPT with grouped-query attention and RoPE):

* ``logits``: the global batch's logits, assembled from every rank's sequence chunks, vocabulary
  shard and sequences (the exact all-gather attention and RoPE positions per chunk);
* ``tangent``: the same for the forward-mode logit tangent along a low-rank direction of every
  target (the tangent rule of the K/V gather and of the bottom-right causal chunks);
* ``sketches``: every TP rank's flat sketch buffer after one backward of the per-token loss sum
  and the reduction over DP x CP (row-parallel partials over TP x DP x CP), with the number of
  collectives that reduction issued and the elements they covered;
* ``sharded_sketches``: the same backward into a buffer sharded over DP x CP (what sharded
  masters use): its reduce-scattered rows, gathered and laid out like the replicated buffer;
* ``embedding_grad``: the word embedding's gradient summed over DP x CP (what Megatron's DDP
  reduces);

and in fp32, ``adam``: the per-step losses and final full weights of three steps of Megatron's
Adam with the distributed optimizer (``setup_training`` + ``train_step``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from harness import Case, run_worker, switch_layout

from megatron_logra.config import load_config
from megatron_logra.context_parallel import held_positions, split_sequence
from megatron_logra.data.lm_batches import Microbatch
from megatron_logra.mcore import gather_full_weights, setup_training, train_step
from megatron_logra.mcore.kl_probe.logit_jvp import LowRankDirection, logit_jvp
from megatron_logra.mcore.models.gpt import build_model
from megatron_logra.mcore.models.targets import TARGET_PATHS, find_targets
from megatron_logra.mcore.tensor_parallel.sketched_linear import LayerSketch
from megatron_logra.projection import generate_projection, projection_key
from megatron_logra.sketch_buffer import FlatSketchBuffer, SketchSlot
from tests.presets import NARROW, tiny_gpt

VOCAB = 100
SEQ = 16
SEQUENCES = 4
SKETCH_RANK = 8
DIRECTION_RANK = 4
ADAM_STEPS = 3
# (name, tp, cp): pairs of a CP layout and its CP=1 reference with the same TP size.
LAYOUTS = (("tp2_dp2", 2, 1), ("tp2_cp2", 2, 2), ("dp4", 1, 1), ("cp2_dp2", 1, 2))
PAIRS = {"tp2_cp2": "tp2_dp2", "cp2_dp2": "dp4"}
TARGETS = list(TARGET_PATHS)


def layout_cfg(tp: int, cp: int, world: int, optimizer: str = "adam"):
    overrides = [
        "parallel.device=cpu", f"parallel.tp={tp}", f"parallel.cp={cp}",
        f"parallel.sp={str(tp > 1).lower()}", *tiny_gpt(**NARROW, seq_length=SEQ),
        "model.num_query_groups=2", "model.activation=swiglu", "model.normalization=RMSNorm",
        "model.add_bias_linear=false", f"optimizer.name={optimizer}", "optimizer.lr=0.01",
        "optimizer.lr_warmup_steps=0", "optimizer.use_distributed_optimizer=true",
        "train.micro_batch_size=1", f"train.global_batch_size={SEQUENCES}",
        f"train.steps={ADAM_STEPS}",
    ]
    return load_config(None, overrides).resolved(world)


def global_batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (SEQUENCES, SEQ + 1), generator=torch.Generator().manual_seed(5))


def my_rows(groups) -> range:
    per_replica = SEQUENCES // groups.data_size
    return range(groups.data_rank * per_replica, (groups.data_rank + 1) * per_replica)


def local_inputs(groups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (tokens, labels, positions): its replica's sequences, its CP chunks."""
    window = global_batch()[list(my_rows(groups))]
    positions = torch.arange(SEQ).expand(window.shape[0], -1)
    return tuple(split_sequence(t.contiguous(), groups.cp_rank, groups.cp_size)
                 for t in (window[:, :-1], window[:, 1:], positions))


def assemble(local: torch.Tensor, groups) -> torch.Tensor | None:
    """The global ``[SEQUENCES, SEQ, V]`` tensor from every rank's ``[b, s_local, V/tp]``
    (on rank 0; None elsewhere). Unwritten entries stay NaN, so a gap cannot pass."""
    piece = (list(my_rows(groups)), held_positions(SEQ, groups.cp_rank, groups.cp_size).tolist(),
             groups.tp_rank, local.detach().double().cpu())
    pieces: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, piece)
    if dist.get_rank() != 0:
        return None
    width = local.shape[-1]
    full = torch.full((SEQUENCES, SEQ, width * groups.tp_size), float("nan"), dtype=torch.float64)
    for rows, positions, tp_rank, values in pieces:
        full[torch.tensor(rows)[:, None], torch.tensor(positions)[None, :],
             tp_rank * width:(tp_rank + 1) * width] = values
    return full


def directions(targets, tp_rank: int) -> dict[str, LowRankDirection]:
    """A low-rank update of every target's local shard, seeded by its layer key and TP rank
    (the same on the CP=1 reference, whose TP size is the same)."""
    out = {}
    for target in targets:
        generator = torch.Generator().manual_seed(
            int.from_bytes(f"{target.layer_key}|{tp_rank}".encode()[-8:], "little") % 2**62)
        cols = target.col_end - target.col_start
        out[target.layer_key] = LowRankDirection(
            torch.randn(target.rows, DIRECTION_RANK, generator=generator, dtype=torch.float64),
            torch.randn(DIRECTION_RANK, cols, generator=generator, dtype=torch.float64) * 0.1)
    return out


def sketch_buffer(targets, groups, sharded: bool) -> FlatSketchBuffer:
    buffer = FlatSketchBuffer(
        [SketchSlot(t.layer_key, t.rows, SKETCH_RANK, t.tp_partial, stride=t.stride)
         for t in targets],
        device="cpu", dtype=torch.float64,
        dp_size=groups.dp_size if sharded else 1, dp_rank=groups.dp_rank if sharded else 0)
    for t in targets:
        full = generate_projection(projection_key(42, 0, t.layer_key), SKETCH_RANK, 0,
                                   t.in_features, "rademacher")
        t.module.logra_sketch = LayerSketch(t.layer_key, full[:, t.col_start:t.col_end].double(),
                                            buffer)
    return buffer


def backward(model, groups) -> None:
    tokens, labels, positions = local_inputs(groups)
    model(tokens, positions, None, labels=labels).sum().backward()


def reduce_counting(buffer: FlatSketchBuffer, groups) -> dict[str, Any]:
    """Reduce the replicated ``buffer`` over DP x CP, counting its collectives."""
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
    return {"collectives": len(issued), "elements": sum(n for _, n in issued),
            "buffer_elements": buffer.data.numel(),
            "partial_elements": buffer.data.numel() - buffer.partial_start,
            "on_flat_buffer": all(start <= ptr < end for ptr, _ in issued),
            "dp_cp_ranks": dist.get_world_size(groups.dp), "tp": groups.tp_size}


def laid_out_like_replicated(sharded: FlatSketchBuffer, targets, groups) -> list[torch.Tensor]:
    """The sharded buffer's reduced rows of every layer, gathered, in the replicated order."""
    gathered = sharded.gathered_data(dp_group=groups.dp)
    layers = []
    for t in targets:
        rows = torch.empty(t.rows, SKETCH_RANK, dtype=torch.float64)
        for piece in sharded.pieces(t.layer_key, gathered):
            rows[piece.row_start:piece.row_end] = piece.view
        layers.append(rows)
    return layers


def per_tp_rank(tensor: torch.Tensor, groups) -> list[torch.Tensor] | None:
    """``tensor`` of DP x CP rank 0 of every TP rank, in TP-rank order (on rank 0)."""
    pieces: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, (groups.tp_rank, groups.dp_rank, tensor.cpu()))
    if dist.get_rank() != 0:
        return None
    return [value for _, _, value in sorted(p for p in pieces if p[1] == 0)]


def measure_fp64(cfg, groups) -> dict[str, Any]:
    model = build_model(cfg, groups, VOCAB).double()
    targets = find_targets([model], TARGETS, tp_rank=groups.tp_rank)
    tokens, _, positions = local_inputs(groups)
    with torch.no_grad():
        logits = model(tokens, positions, None)
    jvp = logit_jvp([model], tokens, positions, targets=targets,
                    directions=directions(targets, groups.tp_rank))
    for t in targets:
        t.weight.requires_grad_(False)
    replicated = sketch_buffer(targets, groups, sharded=False)
    backward(model, groups)
    reduction = reduce_counting(replicated, groups)
    embedding_grad = model.embedding.word_embeddings.weight.grad.clone()
    dist.all_reduce(embedding_grad, group=groups.dp)
    sharded = sketch_buffer(targets, groups, sharded=True)
    model.zero_grad(set_to_none=True)
    backward(model, groups)
    sharded.reduce_(dp_group=groups.dp, tp_group=groups.tp, tp_dp_group=groups.tp_dp,
                    tp_size=groups.tp_size)
    sharded_rows = laid_out_like_replicated(sharded, targets, groups)
    replicated_rows = [replicated.view(t.layer_key).clone() for t in targets]
    return {
        "logits": assemble(logits, groups),
        "tangent": assemble(jvp.tangent, groups),
        "sketches": per_tp_rank(torch.cat([r.flatten() for r in replicated_rows]), groups),
        "sharded_sketches": per_tp_rank(torch.cat([r.flatten() for r in sharded_rows]), groups),
        "reduction": reduction,
        "embedding_grad": per_tp_rank(embedding_grad, groups),
    }


def measure_adam(cfg, groups) -> dict[str, Any]:
    model = build_model(cfg, groups, VOCAB)
    setup = setup_training(cfg, [model], groups)
    window = global_batch()[list(my_rows(groups))]
    batches = [Microbatch(tokens=window[i:i + 1, :-1], labels=window[i:i + 1, 1:],
                          loss_mask=torch.ones(1, SEQ), position_ids=torch.arange(SEQ)[None])
               for i in range(window.shape[0])]
    losses = [train_step(setup, batches, groups=groups, seq_length=SEQ, micro_batch_size=1).loss
              for _ in range(ADAM_STEPS)]
    return {"losses": losses, "weights": gather_full_weights(setup.model_chunks, groups)}


def measure(args, cfg, groups) -> None:
    del cfg
    world = dist.get_world_size()
    results: dict[str, dict[str, Any]] = {}
    for index, (name, tp, cp) in enumerate(LAYOUTS):
        layout = layout_cfg(tp, cp, world)
        if index:
            groups = switch_layout(layout)
        results[name] = {"fp64": measure_fp64(layout, groups), "adam": measure_adam(layout, groups)}
    if dist.get_rank() == 0:
        torch.save(results, args.out / "results.pt")


if __name__ == "__main__":
    run_worker({"context_parallel": Case(lambda args, world: layout_cfg(*LAYOUTS[0][1:], world),
                                         measure, world_sizes=(4,))})
