"""Grouped-GEMM expert sketches vs the per-expert loop vs the dense grouped weight gradient.

    python tools/bench_grouped_sketch.py                         # CPU, a small shape
    python tools/bench_grouped_sketch.py --device cuda --dtype bf16 --json   # the GPU check

One MoE layer's local experts (default: a Qwen3-30B-A3B-like layer at EP=8: 16 local experts,
hidden 2048, expert FFN 768, so fc1 is [1536, 2048]; 4096 tokens x top-8 routed, spread unevenly
over the experts with one idle), sketch rank r. Per expert e with tokens X_e, output gradient
H_e and projection A_e:

* ``grouped``: ``megatron_logra.grouped_sketch``: P = X_e A_e^T and S_e = H_e^T P_e as two
  grouped GEMMs (``torch._grouped_mm``), the design of docs/moe.md "Grouped-GEMM experts";
* ``loop``: the same, one expert at a time (what SequentialMLP's sketched linears do);
* ``dense_wgrad``: the grouped dense weight gradient H_e^T X_e [E, m, n] that the sketch
  replaces (what TEGroupedMLP's backward computes for dense Adam).

Printed: the grouped sketch's relative error against an fp32 (CPU: float64) loop reference, the
idle expert's sketch (must be exactly zero), the median time of each, and the bytes each keeps
(P [T, r] vs X [T, n], S [E, m, r] vs dW [E, m, n]).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from megatron_logra.grouped_sketch import (  # noqa: E402
    expert_offsets,
    grouped_projected_inputs,
    grouped_sketches,
    loop_sketches,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16, help="local experts of the layer")
    parser.add_argument("--hidden", type=int, default=2048, help="the experts' input width n")
    parser.add_argument("--rows", type=int, default=1536, help="the expert linear's rows m")
    parser.add_argument("--tokens", type=int, default=4096 * 8 // 8,
                        help="routed tokens on this rank (default: 4096 x top-8 over EP=8)")
    parser.add_argument("--sketch-rank", type=int, default=256)
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    return parser


def _split(tokens: int, experts: int, generator: torch.Generator) -> torch.Tensor:
    """Uneven counts summing to ``tokens``, the last expert idle (multiples of 16 rows: the
    alignment grouped GEMMs on GPU ask of their splits)."""
    weights = torch.rand(experts - 1, generator=generator) + 0.2
    counts = (weights / weights.sum() * tokens / 16).floor().long() * 16
    counts[0] += tokens - int(counts.sum())
    return torch.cat([counts, torch.zeros(1, dtype=torch.long)])


def _time(fn, reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first call warms up


def run(args: argparse.Namespace) -> dict:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    tokens = _split(args.tokens, args.experts, g)
    n, m, r = args.hidden, args.rows, args.sketch_rank
    x = torch.randn(args.tokens, n, generator=g).to(device, dtype)
    h = (torch.randn(args.tokens, m, generator=g) * 1e-3).to(device, dtype)
    proj = (torch.randn(args.experts, r, n, generator=g) / r**0.5).to(device, dtype)

    grouped = grouped_sketches(h, grouped_projected_inputs(x, proj, tokens), tokens)
    ref_dtype = torch.float64 if device.type == "cpu" else torch.float32
    reference = loop_sketches(x, h, proj, tokens, ref_dtype)
    rel = float((grouped.to(ref_dtype) - reference).norm() / reference.norm())
    offsets = expert_offsets(tokens, device)

    def dense_wgrad():
        return torch._grouped_mm(h.t(), x, offs=offsets)

    element = torch.finfo(dtype).bits // 8
    return {
        "device": str(device), "dtype": args.dtype, "experts": args.experts, "rows": m,
        "hidden": n, "tokens": args.tokens, "sketch_rank": r,
        "tokens_per_expert": tokens.tolist(),
        "grouped_rel_error": rel, "idle_expert_nonzeros": int(torch.count_nonzero(grouped[-1])),
        "grouped_s": _time(lambda: grouped_sketches(h, grouped_projected_inputs(x, proj, tokens),
                                                    tokens), args.reps, device),
        "loop_s": _time(lambda: loop_sketches(x, h, proj, tokens, torch.float32), args.reps,
                        device),
        "dense_wgrad_s": _time(dense_wgrad, args.reps, device),
        "saved_input_bytes": {"sketch": args.tokens * r * element,
                              "dense": args.tokens * n * element},
        "gradient_bytes": {"sketch_fp32": args.experts * m * r * 4,
                           "dense_fp32": args.experts * m * n * 4},
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['experts']} experts, fc [{result['rows']}, {result['hidden']}], "
          f"{result['tokens']} routed tokens, r = {result['sketch_rank']}, {args.dtype} on "
          f"{args.device}; tokens per expert {result['tokens_per_expert']}")
    print(f"grouped vs loop reference: relative error {result['grouped_rel_error']:.2e}; idle "
          f"expert's sketch nonzeros {result['idle_expert_nonzeros']}")
    print(f"time [ms]: grouped sketch {result['grouped_s'] * 1e3:.2f}, per-expert loop "
          f"{result['loop_s'] * 1e3:.2f}, grouped dense wgrad {result['dense_wgrad_s'] * 1e3:.2f}")
    saved, grad = result["saved_input_bytes"], result["gradient_bytes"]
    print(f"kept for the weight gradient: P {saved['sketch'] / 2**20:.1f} MiB vs X "
          f"{saved['dense'] / 2**20:.1f} MiB; sketches {grad['sketch_fp32'] / 2**20:.1f} MiB vs "
          f"dense fp32 grads {grad['dense_fp32'] / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
