"""Sync time and bytes of low-rank updates vs a full refit into the CPU vLLM engine.

    python tools/bench_sync_vllm.py [--hidden 512 --layers 4 --heads 8 --kv-heads 4 --ffn 1408
                                     --vocab 2048 --sketch-rank 16 --updates 5 --tp 1
                                     --transport rpc|collective --json]
    # on GPUs (tools/gpu_check.py): CUDA vLLM on device 1, the channel over NCCL from device 0
    python tools/bench_sync_vllm.py --venv .venv-vllm-cuda --devices 1 --channel-device cuda \
        --transport collective --logprobs --json

Writes a Llama checkpoint of random weights, starts ``VLLMEngine`` (the vLLM venv, ``make
setup-vllm``), then per update sends one low-rank record per target (paper mode: factors in
bf16 on the wire, lr 1, the non-targets frozen), and after the updates times full refits of the
same state (fp32 masters of the targets, everything else in the served dtype, 64 MiB buckets).
Times are wall-clock per update, from the first ``apply_sync`` to the last returning: the pipe
transport, the decode, the shadow's merge on every vLLM worker, the write into vLLM's weights and
the prefix-cache reset. A local ``EngineShadow`` replays the same records, and the engine's
served weights are checked against it at the end (the sync must be exact, not only fast).
``--transport collective`` sends each record's tensor bytes over the sync channel
(``sync.transport=collective``: gloo from the CPU, NCCL with ``--channel-device cuda``), the
header over the pipe. ``--logprobs`` also scores random sequences with vLLM and with Hugging
Face transformers on the shadow's weights (fp32, CPU) and reports the largest difference.
Prints one Markdown table, or with ``--json`` one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_logra.mcore.conversion import (  # noqa: E402
    architecture_from_hf_config,
    hf_tensors_from_megatron,
    write_safetensors,
)
from megatron_logra.rollout.vllm_engine import VLLMEngine  # noqa: E402
from megatron_logra.rollout.vllm_setup import DEFAULT_VLLM_VENV  # noqa: E402
from megatron_logra.sync.checksum import weight_checksums  # noqa: E402
from megatron_logra.sync.records import FactorPiece, LowRankUpdate, full_sync_buckets  # noqa: E402
from megatron_logra.sync.shadow import EngineShadow  # noqa: E402
from megatron_logra.sync.wire import encode  # noqa: E402

BUCKET_BYTES = 64 * 2**20
# Factor entries of this size: a small per-update change, as LoGRA's updates are.
FACTOR_SCALE = 1e-3
MB = 1e6


def _model(args) -> tuple[dict, dict[str, torch.Tensor], list[str]]:
    head_dim = args.hidden // args.heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": args.vocab,
        "hidden_size": args.hidden, "intermediate_size": args.ffn,
        "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False, "mlp_bias": False, "dtype": args.dtype,
    }
    g = torch.Generator().manual_seed(0)
    qkv_rows = (args.heads + 2 * args.kv_heads) * head_dim
    shapes = {"embedding.word_embeddings.weight": (args.vocab, args.hidden),
              "output_layer.weight": (args.vocab, args.hidden),
              "decoder.final_layernorm.weight": (args.hidden,)}
    targets = []
    for i in range(args.layers):
        p = f"decoder.layers.{i}."
        layer = {"self_attention.linear_qkv": (qkv_rows, args.hidden),
                 "self_attention.linear_proj": (args.hidden, args.heads * head_dim),
                 "mlp.linear_fc1": (2 * args.ffn, args.hidden),
                 "mlp.linear_fc2": (args.hidden, args.ffn)}
        shapes |= {p + "input_layernorm.weight": (args.hidden,),
                   p + "pre_mlp_layernorm.weight": (args.hidden,)}
        shapes |= {f"{p}{k}.weight": s for k, s in layer.items()}
        targets += [f"{p}{k}.weight" for k in layer]
    full = {n: (torch.randn(s, generator=g) * 0.02 if len(s) == 2 else torch.ones(s))
            for n, s in shapes.items()}
    return config, full, targets


def _record(name: str, shape: torch.Size, update: int, rank: int, g) -> LowRankUpdate:
    factor = (torch.randn(shape[0], rank, generator=g) * FACTOR_SCALE).bfloat16().float()
    return LowRankUpdate(
        layer_key=name.removesuffix(".weight"), update_count=update, seed=1234,
        projection_count=update - 1, distribution="rademacher", sketch_rank=rank,
        in_features=shape[1], projection_dtype="float32", lr=1.0, weight_decay=0.0,
        pieces=(FactorPiece(((0, shape[0]),), 0, shape[1], factor),))


def _timed(engine: VLLMEngine, payloads: list[bytes]) -> float:
    start = time.perf_counter()
    for payload in payloads:
        engine.apply_sync(payload)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--hidden", 512), ("--layers", 4), ("--heads", 8), ("--kv-heads", 4),
                          ("--ffn", 1408), ("--vocab", 2048), ("--sketch-rank", 16),
                          ("--updates", 5), ("--tp", 1), ("--refits", 3)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--transport", choices=["rpc", "collective"], default="rpc")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VLLM_VENV, help="the vLLM venv")
    parser.add_argument("--devices", type=lambda s: [int(d) for d in s.split(",")], default=[],
                        help="CUDA devices of vLLM's workers (comma-separated); none: CPU vLLM")
    parser.add_argument("--channel-device", choices=["cpu", "cuda"], default="cpu",
                        help="this process's end of the collective channel (cuda: NCCL)")
    parser.add_argument("--logprobs", action="store_true",
                        help="compare vLLM's log-probs with transformers' on the same weights")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.devices and args.channel_device == "cpu":
        # This process trains nothing on a GPU: vLLM may take any device, device 0 included.
        os.environ["LOCAL_WORLD_SIZE"] = "0"
    served = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    config, full, targets = _model(args)
    shadow = EngineShadow(targets, served_dtype=served)
    exact = {n: (t if n in targets else t.to(served)) for n, t in full.items()}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        hf_dir.mkdir()
        arch = architecture_from_hf_config(config)
        write_safetensors(hf_tensors_from_megatron({n: t.to(served) for n, t in full.items()},
                                                   arch), hf_dir)
        (hf_dir / "config.json").write_text(json.dumps(config))
        engine = VLLMEngine(hf_dir, target_names=targets, tensor_parallel=args.tp,
                            dtype=args.dtype, log_path=Path(tmp) / "engine.log",
                            venv=args.venv, transport=args.transport,
                            channel_device=args.channel_device, devices=args.devices)
        started = time.perf_counter()
        engine.start()
        start_s = time.perf_counter() - started
        try:
            rows = _bench(engine, shadow, exact, targets, args)
            match = engine.weight_checksums() == weight_checksums(sorted(
                hf_tensors_from_megatron(shadow.served, arch).items()))
            logprob_diff = (_logprob_diff(engine, config, shadow, arch, args)
                            if args.logprobs else None)
            stats = engine.transport_stats
        finally:
            engine.close()
    params = sum(t.numel() for t in full.values())
    if args.json:
        print(json.dumps({  # noqa: T201
            "params": params, "dtype": args.dtype, "tp": args.tp, "transport": args.transport,
            "channel_device": args.channel_device, "devices": args.devices,
            "engine_start_s": start_s, "weights_match": match,
            "logprob_max_abs_diff": logprob_diff,
            "transport_stats": None if stats is None else vars(stats),
            **{key: {"bytes_per_update": nbytes, "median_s": statistics.median(times),
                     "min_s": min(times), "max_s": max(times)}
               for key, (_, nbytes, times) in zip(("low_rank", "full"), rows, strict=True)}}))
        return 0 if match else 1
    print(f"model: hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
          f"ffn {args.ffn}, vocab {args.vocab} ({params / 1e6:.1f} M params, {args.dtype}); "
          f"sketch rank {args.sketch_rank}; vLLM TP={args.tp}; transport {args.transport}; "
          f"engine start {start_s:.1f} s")
    print("| sync | bytes per update | time per update (median) | min | max |")
    print("|---|---|---|---|---|")
    for label, nbytes, times in rows:
        print(f"| {label} | {nbytes / MB:.3f} MB | {statistics.median(times):.4f} s | "
              f"{min(times):.4f} s | {max(times):.4f} s |")
    low, full_row = rows[0], rows[1]
    print(f"full / low-rank: {full_row[1] / low[1]:.1f}x bytes, "
          f"{statistics.median(full_row[2]) / statistics.median(low[2]):.1f}x time; "
          f"served weights equal the shadow's after the updates: {match}")
    if logprob_diff is not None:
        print(f"log-probs of 4 random sequences, max |vLLM - transformers|: {logprob_diff:.2e}")
    return 0 if match else 1


def _logprob_diff(engine, config, shadow, arch, args) -> float:
    """Largest |vLLM - transformers| log-prob of random sequences on the synced weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**config)).float().eval()
    state = {n: t.float() for n, t in hf_tensors_from_megatron(shadow.served, arch).items()}
    model.load_state_dict(state, strict=True)
    g = torch.Generator().manual_seed(2)
    tokens_BL = torch.randint(0, args.vocab, (4, 24), generator=g)
    with torch.no_grad():
        logits = model(tokens_BL).logits.float()
    reference = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens_BL[:, 1:, None])[..., 0]
    served = torch.tensor(engine.score(tokens_BL.tolist()))
    return float((served - reference).abs().max())


def _bench(engine, shadow, exact, targets, args):
    g = torch.Generator().manual_seed(1)
    initial = full_sync_buckets(exact, update_count=0, bucket_bytes=BUCKET_BYTES)
    for bucket in initial:
        shadow.apply(bucket)
        engine.apply_sync(encode(bucket, wire_dtype="fp32"))
    low_times, low_bytes = [], 0
    for update in range(1, args.updates + 1):
        records = [_record(n, shadow.masters[n].shape, update, args.sketch_rank, g)
                   for n in targets]
        payloads = [encode(r, wire_dtype="bf16") for r in records]
        for record in records:
            shadow.apply(record)
        low_times.append(_timed(engine, payloads))
        low_bytes = sum(len(p) for p in payloads)
    state = {n: (shadow.masters[n] if n in targets else shadow.served[n]) for n in exact}
    full_times, full_bytes = [], 0
    for _ in range(args.refits):
        buckets = full_sync_buckets(state, update_count=args.updates, bucket_bytes=BUCKET_BYTES)
        payloads = [encode(b, wire_dtype="fp32") for b in buckets]
        full_times.append(_timed(engine, payloads))
        full_bytes = sum(len(p) for p in payloads)
    return [("low-rank (U bf16, A regenerated)", low_bytes, low_times),
            ("full refit (buckets)", full_bytes, full_times)]


if __name__ == "__main__":
    sys.exit(main())
