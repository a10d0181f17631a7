"""The memory estimator beside the measured peak live tensors of the model the product builds.

    python tools/estimate_vs_measured.py                       # bench model, 1x2048, fp32+bf16
    python tools/estimate_vs_measured.py --seq-lengths 2048,8192 --recompute none,full
    python tools/estimate_vs_measured.py --hidden 256 --ffn 1024 --seq-lengths 512 --json
    torchrun --nproc_per_node=2 tools/estimate_vs_measured.py --cp 2 --seq-lengths 2048

For every (sequence length, precision, attention, recompute mode, method) this builds the run's
own model and optimizer from config overrides (``megatron_logra.mcore.training.step_peak``: the
live-tensor tracker, one warm-up step, then one measured step, the realised-KL pass included
under KL control) and prints the measured peak beside
:func:`megatron_logra.memory.from_config.estimate_for_config` of the same config, with the
relative error. One process, one rank (tp = pp = dp = 1), CPU; with ``--cp N``, N processes
under torchrun (context parallelism: each sequence split over them), the measured peak being
the largest of any rank's, which is what the estimate describes.

Methods: ``dense_adam`` (Megatron's Adam on everything), ``lora`` (frozen base, Adam on rank-r
adapters), ``logra`` (library mode: RowAdam on sketched targets, Adam on the rest) and
``logra_paper`` (paper mode: every non-target frozen, the update ratio from the weight norms,
predicted-KL step control on the batch's first sequences).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

METHOD_OVERRIDES: dict[str, list[str]] = {
    "dense_adam": ["optimizer.name=adam"],
    "lora": ["optimizer.name=lora"],
    "logra": ["optimizer.name=logra"],
    "logra_paper": ["optimizer.name=logra", "logra.mode=paper", "logra.update_ratio=1e-3",
                    "logra.kl_control.enabled=true"],
}
METHODS = tuple(METHOD_OVERRIDES)
TOLERANCE = 0.10
"""The issue's claim: |estimate / measured - 1| <= 10% on every configuration."""
UNMEASURABLE = {("local", "logra_paper"): "the KL probe's forward-mode pass through local "
                "attention's baddbmm crashes torch (segmentation fault) under the live-tensor "
                "tracker's dispatch mode; training runs it fine"}
"""(attention, method) pairs the tracker cannot measure, with the reason."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=3072, help="ffn hidden size (SwiGLU)")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=64, help="LoRA rank = LoGRA sketch rank")
    parser.add_argument("--qk-layernorm", action="store_true", help="model.qk_layernorm=true")
    moe = parser.add_argument_group("mixture of experts (an MoE bench model)")
    moe.add_argument("--experts", type=int, help="model.num_moe_experts (default: dense)")
    moe.add_argument("--topk", type=int, default=2, help="model.moe_router_topk")
    moe.add_argument("--expert-ffn", type=int, help="model.moe_ffn_hidden_size")
    moe.add_argument("--shared-ffn", type=int,
                     help="model.moe_shared_expert_ffn_hidden_size (default: none)")
    moe.add_argument("--moe-layer-freq", type=int, default=1, help="model.moe_layer_freq")
    moe.add_argument("--router-pre-softmax", action="store_true",
                     help="model.moe_router_pre_softmax=true")
    moe.add_argument("--shared-gate", action="store_true", help="model.moe_shared_expert_gate=true")
    parser.add_argument("--seq-lengths", default="2048", help="comma-separated, batch 1 each")
    parser.add_argument("--dtypes", default="fp32,bf16", help="model.params_dtype values")
    parser.add_argument("--attention", default="sdpa", help="model.attention values")
    parser.add_argument("--recompute", default="none,full", help="model.recompute values")
    parser.add_argument("--configs",
                        help="comma-separated DTYPE:ATTENTION:RECOMPUTE triples, instead of "
                        "the product of --dtypes, --attention and --recompute")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--cp", type=int, default=1,
                        help="parallel.cp: run under torchrun --nproc_per_node=CP")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    return parser


def _split(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def overrides(args: argparse.Namespace, *, method: str, dtype: str, attention: str,
              recompute: str, seq_length: int) -> list[str]:
    if method not in METHOD_OVERRIDES:
        raise ValueError(f"--methods contains {method!r}; choose from {list(METHODS)}")
    return [
        "parallel.device=cpu", "parallel.tp=1", f"parallel.cp={args.cp}",
        f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
        f"model.num_attention_heads={args.heads}", f"model.ffn_hidden_size={args.ffn}",
        f"model.seq_length={seq_length}", f"model.vocab_size={args.vocab}",
        "model.activation=swiglu", "model.normalization=RMSNorm", "model.add_bias_linear=false",
        f"model.params_dtype={dtype}", f"model.attention={attention}",
        f"model.recompute={recompute}",
        "train.micro_batch_size=1", "train.global_batch_size=1", "train.steps=4",
        f"lora.lora_rank={args.rank}", f"lora.alpha={2 * args.rank}",
        f"logra.sketch_rank={args.rank}", f"logra.kl_control.probe_max_tokens={seq_length}",
        *METHOD_OVERRIDES[method], *moe_overrides(args),
        *(["model.qk_layernorm=true"] if args.qk_layernorm else []),
    ]


def moe_overrides(args: argparse.Namespace) -> list[str]:
    """The MoE keys of the bench model (none for a dense one)."""
    if args.experts is None:
        return []
    out = [f"model.num_moe_experts={args.experts}", f"model.moe_router_topk={args.topk}",
           f"model.moe_layer_freq={args.moe_layer_freq}"]
    if args.expert_ffn is not None:
        out.append(f"model.moe_ffn_hidden_size={args.expert_ffn}")
    if args.shared_ffn is not None:
        out.append(f"model.moe_shared_expert_ffn_hidden_size={args.shared_ffn}")
    if args.router_pre_softmax:
        out.append("model.moe_router_pre_softmax=true")
    if args.shared_gate:
        out.append("model.moe_shared_expert_gate=true")
    return out


def compare(cfg: Any, groups: Any, vocab_size: int) -> dict[str, Any]:
    """One configuration: measured peak, estimate, relative error (all bytes)."""
    import torch.distributed as dist

    from megatron_logra.mcore.training.step_peak import as_dict, measure_step_peak
    from megatron_logra.memory.from_config import estimate_for_config

    start = time.perf_counter()
    measured = measure_step_peak(cfg, groups, vocab_size=vocab_size)
    if groups.world_size > 1:
        # The estimate is one GPU's: the largest rank's (CP ranks differ in their chunks).
        every: list[Any] = [None] * groups.world_size
        dist.all_gather_object(every, measured)
        measured = max(every, key=lambda peak: peak.peak_bytes)
    estimate = estimate_for_config(cfg, vocab_size=vocab_size)
    return {
        "measured": as_dict(measured),
        "estimate": estimate.as_dict(),
        "relative_error": estimate.total / measured.peak_bytes - 1.0,
        "persistent_relative_error": estimate.persistent / measured.persistent_bytes - 1.0,
        "seconds": time.perf_counter() - start,
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from megatron_logra.config import load_config
    from megatron_logra.mcore.process_groups import (
        destroy_parallel,
        init_parallel,
        world_size_from_env,
    )

    torch.set_num_threads(args.threads)
    triples = [(d, a, r) for d in _split(args.dtypes) for a in _split(args.attention)
               for r in _split(args.recompute)]
    if args.configs:
        triples = [tuple(item.split(":")) for item in _split(args.configs)]
        for triple in triples:
            if len(triple) != 3:
                raise ValueError(f"--configs item {':'.join(triple)!r} is not "
                                 "DTYPE:ATTENTION:RECOMPUTE, e.g. fp32:sdpa:full")
    grid = [(s, d, a, r, m) for s in map(int, _split(args.seq_lengths))
            for d, a, r in triples for m in _split(args.methods)
            if (a, m) not in UNMEASURABLE]
    for (attention, method), why in UNMEASURABLE.items():
        if any(a == attention for _, a, _ in triples) and method in _split(args.methods):
            print(f"not measured: {method} with {attention} attention: {why}", file=sys.stderr)
    rows = []
    groups = None
    try:
        for seq, dtype, attention, recompute, method in grid:
            if world_size_from_env() != args.cp:
                raise ValueError(f"--cp={args.cp} needs as many processes: run under torchrun "
                                 f"--nproc_per_node={args.cp} (this world has "
                                 f"{world_size_from_env()})")
            cfg = load_config(None, overrides(args, method=method, dtype=dtype,
                                              attention=attention, recompute=recompute,
                                              seq_length=seq)).resolved(args.cp)
            if groups is None:
                groups = init_parallel(cfg)
            row = {"seq_length": seq, "dtype": dtype, "attention": attention,
                   "recompute": recompute, "method": method}
            row.update(compare(cfg, groups, args.vocab))
            rows.append(row)
            if not args.json and groups.world_rank == 0:
                print(format_row(row), flush=True)
    finally:
        if groups is not None:
            destroy_parallel()
    return rows


def _mib(value: float) -> str:
    return f"{value / 2**20:,.1f}"


HEADER = ("| tokens | dtype | attention | recompute | method | measured peak [MiB] | estimate [MiB]"
          " | error | measured persistent | estimated persistent | peak in |\n"
          "|---:|---|---|---|---|---:|---:|---:|---:|---:|---|")


def format_row(row: dict[str, Any]) -> str:
    m, e = row["measured"], row["estimate"]
    where = "realised KL" if m["peak_in_realised_kl"] else "step"
    return (f"| 1x{row['seq_length']} | {row['dtype']} | {row['attention']} | {row['recompute']}"
            f" | {row['method']} | {_mib(m['peak_bytes'])} | {_mib(e['total_bytes'])}"
            f" | {100 * row['relative_error']:+.1f}% | {_mib(m['persistent_bytes'])}"
            f" | {_mib(e['persistent_bytes'])} | {where} |")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    first = os.environ.get("RANK", "0") == "0"  # under torchrun (--cp) one rank reports
    try:
        for method in _split(args.methods):
            if method not in METHOD_OVERRIDES:
                raise ValueError(f"--methods contains {method!r}; choose from {list(METHODS)}")
        if not args.json and first:
            print(HEADER, flush=True)
        rows = run(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not first:
        return 0
    if args.json:
        print(json.dumps(rows, indent=1))
    worst = max(abs(row["relative_error"]) for row in rows)
    print(f"largest |estimate / measured - 1| = {100 * worst:.1f}% "
          f"(claim: <= {100 * TOLERANCE:.0f}%)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
