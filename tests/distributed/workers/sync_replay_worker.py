"""The real LoGRAOptimizer's sync records replayed by the engine's shadow (run with torchrun, 1
process).

Two trainers in one process (SwiGLU: fc1 is [gate; up]), each trained ``--updates`` real steps through Megatron's schedule
on the tiny GPT, with a listener on its LoGRA optimizer:

* ``library_fp32``: library mode, fp32 weights (their own masters), weight decay, Adam on the
  non-targets (shipped dense), fp32 on the wire;
* ``paper_bf16``: paper mode, bf16 weights with fp32 row masters, the bf16-rounded factor, bf16
  on the wire, frozen non-targets (nothing dense to ship).

The engine starts from a full sync of the initial state, then receives every record through
the wire encoding. The ``tp2`` case (2 processes) trains the library trainer at TP=2 and feeds
one engine with full (TP=1) shadows the combined records of both ranks; it compares the target
weights (the TP=1 layout of non-targets is not mapped yet, docs/sync.md). Writes ``--out/result.json``: per variant, the records applied, the names
whose served weight differs from the trainer's (torch.equal) and whose checksum differs, and how many
target weights the updates changed at all (so that equality is not the trivial kind).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from harness import Case, run_worker

from megatron_logra.config import load_config
from megatron_logra.data.dataset_dir import load_tokenizer, load_tokens
from megatron_logra.data.lm_batches import LMBatchSchedule
from megatron_logra.mcore.models.gpt import build_model_chunks
from megatron_logra.mcore.optimizer.logra_state import global_row_ranges
from megatron_logra.mcore.training.setup import setup_training
from megatron_logra.mcore.training.step import train_step
from megatron_logra.sync.checksum import mismatched_weights, weight_checksums
from megatron_logra.sync.records import DenseUpdate, combine_rank_records, full_sync_buckets
from megatron_logra.sync.shadow import EngineShadow
from megatron_logra.sync.wire import decode, encode
from tests.presets import SWIGLU_RMSNORM_NO_BIAS, tiny_gpt

VARIANTS: dict[str, tuple[list[str], str]] = {
    "library_fp32": (["logra.mode=library", "model.params_dtype=fp32",
                      "optimizer.weight_decay=0.1", "optimizer.lr=3e-3"], "fp32"),
    "paper_bf16": (["logra.mode=paper", "model.params_dtype=bf16",
                    "logra.update_factor_dtype=bf16", "logra.update_ratio=1e-3"], "bf16"),
}
# Bucket size of the full syncs: small, so the tiny model's full sync spans several buckets.
BUCKET_BYTES = 64 * 1024


def variant_cfg(args, world: int, variant: str):
    overrides = [
        "parallel.device=cpu", f"parallel.tp={world}", *tiny_gpt(), *SWIGLU_RMSNORM_NO_BIAS, "train.micro_batch_size=4",
        "train.global_batch_size=4", "optimizer.name=logra", f"data.dir={args.data}",
        *VARIANTS[variant][0],
    ]
    return load_config(None, overrides).resolved(world)


def build_cfg(args, world: int):
    return variant_cfg(args, world, "library_fp32")


def _trainer_state(setup) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(exact state for a full sync, served weights): targets by layer key, masters for bf16."""
    targets = {id(t.weight): t for t in setup.logra.targets}
    exact, served = {}, {}
    for chunk in setup.model_chunks:
        for name, param in chunk.named_parameters():
            target = targets.get(id(param))
            if target is None:
                exact[name] = served[name] = param.detach()
                continue
            key = f"{target.layer_key}.weight"
            master = setup.logra.masters.get(target.layer_key)
            exact[key] = master.master_OI if master is not None else param.detach()
            served[key] = param.detach()
    return exact, served


def _trainer(cfg, groups):
    """The run's training setup and batches, and the list its LoGRA optimizer's update records
    are appended to."""
    tokenizer = load_tokenizer(cfg.data.dir)
    schedule = LMBatchSchedule(load_tokens(cfg.data.dir), seq_length=32, global_batch_size=4,
                               seed=cfg.train.seed)
    setup = setup_training(cfg, build_model_chunks(cfg, groups, tokenizer.vocab_size), groups)
    records = []
    setup.logra.update_listener = records.extend
    return setup, schedule, records


def replay(args, groups, variant: str) -> dict:
    cfg = variant_cfg(args, 1, variant)
    wire_dtype = VARIANTS[variant][1]
    setup, schedule, records = _trainer(cfg, groups)
    exact, served = _trainer_state(setup)
    engine = EngineShadow([f"{t.layer_key}.weight" for t in setup.logra.targets],
                          served_dtype=setup.logra.compute_dtype)
    for bucket in full_sync_buckets(exact, update_count=0, bucket_bytes=BUCKET_BYTES):
        engine.apply(decode(encode(bucket, wire_dtype="fp32")))
    initial = {n: t.clone() for n, t in served.items() if n in engine.target_names}
    applied = dense = 0
    for update in range(1, args.updates + 1):
        before = {n: t.clone() for n, t in served.items()}
        train_step(setup, schedule.microbatches(update, dp_rank=0, dp_size=1,
                                                micro_batch_size=4),
                   groups=groups, seq_length=32, micro_batch_size=4)
        for record in records:
            engine.apply(decode(encode(record, wire_dtype=wire_dtype)))
            applied += 1
        records.clear()
        for name, tensor in served.items():
            if name not in engine.target_names and not torch.equal(tensor, before[name]):
                engine.apply(decode(encode(DenseUpdate(name, update, tensor.clone()),
                                           wire_dtype=wire_dtype)))
                dense += 1
    return {
        "low_rank_records": applied,
        "dense_records": dense,
        "num_targets": len(setup.logra.targets),
        "update_count": setup.logra.update_count,
        "targets_changed": sum(not torch.equal(t, served[n]) for n, t in initial.items()),
        "unequal": sorted(n for n, t in served.items() if not torch.equal(engine.served[n], t)),
        "checksum_mismatches": mismatched_weights(weight_checksums(served.items()),
                                                  engine.checksums()),
        "served_dtype": str(engine.served_dtype),
    }


def _global_blocks(setup, groups, tensor_of) -> dict[str, torch.Tensor]:
    """Each target's full (TP=1) tensor assembled from every rank's block (on every rank)."""
    mine = {}
    for target in setup.logra.targets:
        mine[target.layer_key] = (global_row_ranges(setup.logra, target), target.col_start,
                                  target.col_end, target.in_features,
                                  tensor_of(target).detach().clone())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    full = {}
    for key in mine:
        blocks = [rank[key] for rank in gathered]
        rows = max(hi for ranges, *_ in blocks for _, hi in ranges)
        out = torch.zeros(rows, blocks[0][3], dtype=blocks[0][4].dtype)
        for ranges, lo_col, hi_col, _, tensor in blocks:
            start = 0
            for lo, hi in ranges:
                out[lo:hi, lo_col:hi_col] = tensor[start : start + hi - lo]
                start += hi - lo
        full[f"{key}.weight"] = out
    return full


def measure_tp2(args, cfg, groups):
    setup, schedule, records = _trainer(cfg, groups)
    weights = _global_blocks(setup, groups, lambda t: t.weight)
    engine = EngineShadow(weights, served_dtype=torch.float32)
    for bucket in full_sync_buckets(weights, update_count=0, bucket_bytes=BUCKET_BYTES):
        engine.apply(bucket)
    applied = 0
    for update in range(1, args.updates + 1):
        train_step(setup, schedule.microbatches(update, dp_rank=0, dp_size=1,
                                                micro_batch_size=4),
                   groups=groups, seq_length=32, micro_batch_size=4)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, records)
        records.clear()
        for record in combine_rank_records(per_rank):
            engine.apply(decode(encode(record, wire_dtype="fp32")))
            applied += 1
    served = _global_blocks(setup, groups, lambda t: t.weight)
    return {
        "low_rank_records": applied,
        "num_targets": len(setup.logra.targets),
        "update_count": setup.logra.update_count,
        "targets_changed": sum(not torch.equal(weights[n], t) for n, t in served.items()),
        "unequal": sorted(n for n, t in served.items() if not torch.equal(engine.served[n], t)),
    }


def measure(args, cfg, groups):
    del cfg
    return {variant: replay(args, groups, variant) for variant in VARIANTS}


def add_arguments(parser) -> None:
    parser.add_argument("--data", required=True)
    parser.add_argument("--updates", type=int, default=20)


if __name__ == "__main__":
    run_worker({
        "sync_replay": Case(build_cfg, measure, world_sizes=(1,)),
        "tp2": Case(build_cfg, measure_tp2, output="tp2.json", world_sizes=(2,)),
    }, add_arguments)
