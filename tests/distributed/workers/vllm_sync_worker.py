"""A real trainer's sync stream for the vLLM engine tests (run with torchrun, 2 processes).

Trains the tiny GPT (SwiGLU, RMSNorm, grouped-query attention with head width 32: CPU vLLM needs
>= 32) ``--updates`` real LoGRA steps at a two-process layout, with a listener on its optimizer,
and writes under ``--out`` (rank 0):

* ``hf/``: the initial weights as a Hugging Face checkpoint, through our converter's mapping
  (config.json from the model section, tensors by ``hf_tensors_from_megatron``);
* ``stream.pkl``: ``[(update, wire bytes)]`` in send order -- the full sync of the initial exact
  state (the targets' fp32 masters), then per update the combined low-rank records of all ranks
  and the dense non-targets that changed;
* ``result.json``: the trainer's checksums of its served weights in the Hugging Face layout
  after the last update and after the one before, the target names, a batch of the training
  data's token sequences and the trainer's log-probs of them (temperature 1), recomputed after
  the last update.

Case ``dp2``: paper mode, bf16 weights with fp32 masters, bf16 factors on the wire, DP=2. (The
fp32 TP=2 library-mode trainer of the vLLM tests is the RL job itself, through the CLI.)

Case ``delta``: ``sync.mode=delta`` streams of bf16 weights at TP=2, one per optimizer (dense
Adam, LoRA served merged, LoGRA paper mode), for the dp2 case's vLLM engine (same model and
tokenizer): ``delta_streams.pkl`` holds per optimizer the wire bytes of each update in order --
a full sync of the served weights (targets in bf16: no fp32 master on the engine), then per
update the delta buckets against the previous update, as ``PolicySync`` ships them -- and
``result.json`` the trainer's checksums in the Hugging Face layout after each.
"""

from __future__ import annotations

import json
import pickle

import torch
import torch.distributed as dist
from harness import Case, run_worker
from sync_replay_worker import _global_blocks

from megatron_logra.config import load_config
from megatron_logra.data.dataset_dir import load_tokenizer, load_tokens
from megatron_logra.data.lm_batches import LMBatchSchedule
from megatron_logra.mcore import compute_token_logprobs, gather_full_weights
from megatron_logra.mcore.conversion import (
    architecture_from_hf_config,
    hf_config_from_model_config,
    hf_tensors_from_megatron,
    write_safetensors,
)
from megatron_logra.mcore.models.gpt import build_model_chunks
from megatron_logra.mcore.models.sync_state import served_weights
from megatron_logra.mcore.training.setup import setup_training
from megatron_logra.mcore.training.step import train_step
from megatron_logra.sync.checksum import weight_checksums
from megatron_logra.sync.delta import delta_buckets
from megatron_logra.sync.records import DenseUpdate, combine_rank_records, full_sync_buckets
from megatron_logra.sync.wire import encode
from tests.presets import SWIGLU_RMSNORM_NO_BIAS, tiny_gpt

SEQ_LENGTH = 32
GLOBAL_BATCH = 4
# The model's context (the served max_model_len) holds a training window plus generated tokens.
# Head width 32 (CPU vLLM's attention refuses 16) and 2 query groups of 2 heads: linear_qkv's
# per-group interleave differs from vLLM's [q; k; v], and TP=2 splits whole groups.
MODEL = [*tiny_gpt(hidden_size=128, ffn_hidden_size=256, seq_length=2 * SEQ_LENGTH), "model.num_query_groups=2",
         *SWIGLU_RMSNORM_NO_BIAS]
CASES: dict[str, tuple[list[str], str]] = {
    "dp2": (["parallel.tp=1", "logra.mode=paper", "model.params_dtype=bf16",
             "logra.update_factor_dtype=bf16", "logra.update_ratio=1e-3"], "bf16"),
}
BUCKET_BYTES = 256 * 1024


def build_cfg(args, world: int):
    overrides = ["parallel.device=cpu", *MODEL, "train.micro_batch_size=2",
                 f"train.global_batch_size={GLOBAL_BATCH}", "optimizer.name=logra",
                 f"data.dir={args.data}", *CASES[args.case][0]]
    return load_config(None, overrides).resolved(world)


def _hf_weights(full: dict[str, torch.Tensor], arch, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return hf_tensors_from_megatron({n: t.to(dtype) for n, t in full.items()}, arch)


def measure(args, cfg, groups):
    wire_dtype = CASES[args.case][1]
    tokenizer = load_tokenizer(cfg.data.dir)
    dp_rank, dp_size = groups.dp_rank, groups.dp_size
    schedule = LMBatchSchedule(load_tokens(cfg.data.dir), seq_length=SEQ_LENGTH,
                               global_batch_size=GLOBAL_BATCH, seed=cfg.train.seed)
    chunks = build_model_chunks(cfg, groups, tokenizer.vocab_size)
    setup = setup_training(cfg, chunks, groups)
    records: list = []
    setup.logra.update_listener = records.extend
    dtype = setup.logra.compute_dtype
    targets = [f"{t.layer_key}.weight" for t in setup.logra.targets]
    config_json = hf_config_from_model_config(cfg.model, vocab_size=tokenizer.vocab_size,
                                              dtype=dtype)
    arch = architecture_from_hf_config(config_json)

    full = gather_full_weights(setup.model_chunks, groups)
    masters = _global_blocks(setup, groups, lambda t: (
        setup.logra.masters[t.layer_key].master_OI if t.layer_key in setup.logra.masters
        else t.weight))
    exact = {n: (masters[n] if n in masters else t.to(dtype)) for n, t in full.items()}
    stream = [(0, encode(b, wire_dtype="fp32"))
              for b in full_sync_buckets(exact, update_count=0, bucket_bytes=BUCKET_BYTES)]
    if dist.get_rank() == 0:
        (args.out / "hf").mkdir(exist_ok=True)
        write_safetensors(_hf_weights(full, arch, dtype), args.out / "hf")
        (args.out / "hf" / "config.json").write_text(json.dumps(config_json, indent=1))
    checksums, dense = [], 0
    for update in range(1, args.updates + 1):
        train_step(setup, schedule.microbatches(update, dp_rank=dp_rank, dp_size=dp_size,
                                                micro_batch_size=2),
                   groups=groups, seq_length=SEQ_LENGTH, micro_batch_size=2)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, records)
        records.clear()
        stream += [(update, encode(r, wire_dtype=wire_dtype))
                   for r in combine_rank_records(per_rank)]
        new_full = gather_full_weights(setup.model_chunks, groups)
        for name, tensor in new_full.items():
            if name not in targets and not torch.equal(tensor, full[name]):
                stream.append((update, encode(DenseUpdate(name, update, tensor.to(dtype)),
                                              wire_dtype=wire_dtype)))
                dense += 1
        full = new_full
        checksums.append(weight_checksums(sorted(_hf_weights(full, arch, dtype).items())))

    window, _ = schedule.windows(schedule.global_batch_indices(0))
    tokens_BL = window[:, :-1].contiguous()
    logprobs = compute_token_logprobs(
        setup.model_chunks, tokens_BL[:, :-1].contiguous(), tokens_BL[:, 1:].contiguous(),
        temperature=1.0, vocab_size=tokenizer.vocab_size, groups=groups, micro_batch_size=2)
    if dist.get_rank() == 0:
        (args.out / "stream.pkl").write_bytes(pickle.dumps(stream))
    return {
        "targets": targets, "served_dtype": str(dtype).removeprefix("torch."),
        "update_count": setup.logra.update_count,
        "checksums": checksums[-1], "previous_checksums": checksums[-2],
        "tokens": tokens_BL.tolist(), "logprobs": logprobs.float().tolist(),
        "dense_records": dense,
    }


# Step sizes at which a bf16 step flips a few to some tens of percent of the entries.
DELTA_CASES: dict[str, list[str]] = {
    "adam": ["optimizer.name=adam", "optimizer.lr=1e-5"],
    "lora": ["optimizer.name=lora", "optimizer.lr=1e-3", "lora.lora_rank=4"],
    "logra": ["optimizer.name=logra", "logra.mode=paper", "logra.update_factor_dtype=bf16",
              "logra.update_ratio=1e-3"],
}


def delta_cfg(args, world: int, optimizer: str = "adam"):
    overrides = ["parallel.device=cpu", *MODEL, "train.micro_batch_size=2",
                 f"train.global_batch_size={GLOBAL_BATCH}", "parallel.tp=2",
                 "model.params_dtype=bf16", f"data.dir={args.data}", *DELTA_CASES[optimizer]]
    return load_config(None, overrides).resolved(world)


def _delta_stream(args, groups, optimizer: str) -> tuple[list[list[bytes]], dict]:
    """What PolicySync ships in delta mode over ``args.updates`` real steps (rank 0)."""
    cfg = delta_cfg(args, groups.world_size, optimizer)
    tokenizer = load_tokenizer(cfg.data.dir)
    schedule = LMBatchSchedule(load_tokens(cfg.data.dir), seq_length=SEQ_LENGTH,
                               global_batch_size=GLOBAL_BATCH, seed=cfg.train.seed)
    setup = setup_training(cfg, build_model_chunks(cfg, groups, tokenizer.vocab_size), groups)
    arch = architecture_from_hf_config(hf_config_from_model_config(
        cfg.model, vocab_size=tokenizer.vocab_size, dtype=torch.bfloat16))
    rank0 = dist.get_rank() == 0
    state = served_weights(setup.model_chunks, groups)
    updates = [[encode(b, wire_dtype="fp32") for b in full_sync_buckets(
        state, update_count=0, bucket_bytes=BUCKET_BYTES)] if rank0 else []]
    counts = dict.fromkeys(state, 0)
    checksums = [weight_checksums(sorted(_hf_weights(state, arch, torch.bfloat16).items()))]
    changed = []
    for update in range(1, args.updates + 1):
        train_step(setup, schedule.microbatches(update, dp_rank=groups.dp_rank,
                                                dp_size=groups.dp_size, micro_batch_size=2),
                   groups=groups, seq_length=SEQ_LENGTH, micro_batch_size=2)
        new = served_weights(setup.model_chunks, groups)
        if rank0:
            buckets = delta_buckets(new, state, counts, update_count=update,
                                    bucket_bytes=BUCKET_BYTES)
            updates.append([encode(b, wire_dtype="fp32") for b in buckets])
            counts.update({n: update for b in buckets for n in b.tensors})
            changed.append(sum(t.changed for b in buckets for t in b.tensors.values())
                           / sum(t.numel() for t in new.values()))
            checksums.append(weight_checksums(sorted(_hf_weights(new, arch, torch.bfloat16)
                                                     .items())))
        state = new
    return updates, {"checksums": checksums, "changed_fraction": changed,
                     "bytes": [sum(len(p) for p in payloads) for payloads in updates]}


def measure_delta(args, _cfg, groups):
    streams, report = {}, {}
    for optimizer in DELTA_CASES:
        streams[optimizer], report[optimizer] = _delta_stream(args, groups, optimizer)
    if dist.get_rank() == 0:
        (args.out / "delta_streams.pkl").write_bytes(pickle.dumps(streams))
    return report


def add_arguments(parser) -> None:
    parser.add_argument("--data", required=True)
    parser.add_argument("--updates", type=int, default=4)


if __name__ == "__main__":
    run_worker({**{case: Case(build_cfg, measure, world_sizes=(2,)) for case in CASES},
                "delta": Case(delta_cfg, measure_delta, world_sizes=(2,))}, add_arguments)
