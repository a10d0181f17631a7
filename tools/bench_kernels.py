"""The backward cost of a LoGRA sketch against the dense weight gradient it replaces.

    python tools/bench_kernels.py [--threads 1] [--kernel-reps 5] [--json]

``H^T (X A^T)`` (plus the projection ``X A^T``) vs ``H^T X``, timed at a small model's target
shapes and at a large realistic layer (hidden 4096, ffn 14336, 8 KV groups, T = 4096, r = 256).
``tools/bench_methods.py`` runs it after the methods unless ``--no-kernels``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch


def add_kernel_arguments(parser: argparse.ArgumentParser) -> None:
    kern = parser.add_argument_group("backward kernels")
    kern.add_argument("--kernel-reps", type=int, default=5,
                      help="repetitions per kernel at the model's shapes")
    kern.add_argument("--large-reps", type=int, default=3,
                      help="repetitions per kernel at the large shapes (each H^T X there is "
                           "~1e12 flops: seconds on a CPU)")
    kern.add_argument("--kernel-tokens", type=int, default=4096,
                      help="tokens T of the large realistic layer")
    kern.add_argument("--kernel-sketch-rank", type=int, default=256,
                      help="sketch rank of the large realistic layer")


@dataclass(frozen=True)
class KernelShape:
    label: str
    tokens: int
    rows: int  # m: output features of the layer shard
    cols: int  # n: input features of the layer shard
    sketch_rank: int


def _model_kernel_shapes(args: argparse.Namespace) -> list[KernelShape]:
    h, f, r = args.hidden, args.ffn, args.sketch_rank
    t = args.seq_length * args.micro_batch_size
    return [
        KernelShape(f"model qkv   [{3 * h}x{h}]", t, 3 * h, h, r),
        KernelShape(f"model proj  [{h}x{h}]", t, h, h, r),
        KernelShape(f"model fc1   [{2 * f}x{h}]", t, 2 * f, h, r),
        KernelShape(f"model fc2   [{h}x{f}]", t, h, f, r),
    ]


def _large_kernel_shapes(args: argparse.Namespace) -> list[KernelShape]:
    # A Llama-3-8B-like layer: hidden 4096, 32 query heads in 8 KV groups of width 128,
    # SwiGLU ffn 14336.
    t, r = args.kernel_tokens, args.kernel_sketch_rank
    return [
        KernelShape("large qkv   [6144x4096]", t, 6144, 4096, r),
        KernelShape("large proj  [4096x4096]", t, 4096, 4096, r),
        KernelShape("large fc1   [28672x4096]", t, 28672, 4096, r),
        KernelShape("large fc2   [4096x14336]", t, 4096, 14336, r),
    ]


def _median_time(fn: Any, reps: int, on_gpu: bool) -> float:
    """Median seconds of ``fn``: wall time on a GPU, CPU time of this process on a CPU (robust
    to other processes on a shared machine; equal to wall time times the busy threads)."""
    clock = time.perf_counter if on_gpu else time.process_time
    fn()  # warm-up: first-call allocation and kernel selection
    times = []
    for _ in range(reps):
        if on_gpu:
            torch.cuda.synchronize()
        start = clock()
        fn()
        if on_gpu:
            torch.cuda.synchronize()
        times.append(clock() - start)
    return statistics.median(times)


def time_kernels(shape: KernelShape, reps: int, device: torch.device) -> dict[str, Any]:
    """Median times of the dense weight gradient ``H^T X`` and of LoGRA's replacement: the
    projection ``P = X A^T`` (forward) and the sketch ``H^T P`` (backward)."""
    on_gpu = device.type == "cuda"
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape.tokens, shape.cols, device=device, generator=generator)
    h = torch.randn(shape.tokens, shape.rows, device=device, generator=generator)
    a = torch.randn(shape.sketch_rank, shape.cols, device=device, generator=generator)
    p = x @ a.t()
    dense = _median_time(lambda: h.t() @ x, reps, on_gpu)
    projection = _median_time(lambda: x @ a.t(), reps, on_gpu)
    sketch = _median_time(lambda: h.t() @ p, reps, on_gpu)
    m, n, r = shape.rows, shape.cols, shape.sketch_rank
    return {
        "label": shape.label, "tokens": shape.tokens, "rows": m, "cols": n, "sketch_rank": r,
        "reps": reps, "dense_wgrad_s": dense, "projection_s": projection, "sketch_s": sketch,
        "logra_over_dense": (projection + sketch) / dense,
        "flops_ratio": r * (m + n) / (m * n),
    }


def run_kernels(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available()
                          else "cpu")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = [time_kernels(shape, args.kernel_reps, device) for shape in _model_kernel_shapes(args)]
    rows += [time_kernels(shape, args.large_reps, device) for shape in _large_kernel_shapes(args)]
    return rows


def format_kernels(rows: list[dict[str, Any]], load: tuple[float, float, float]) -> str:
    lines = [
        f"weight-gradient cost, fp32, median of reps timings after one warm-up call (CPU: "
        f"process CPU seconds, {torch.get_num_threads()} threads); load average {load[0]:.2f} "
        f"on {os.cpu_count()} CPUs",
        f"{'layer [m x n]':<28}{'T':>6}{'r':>5}{'reps':>5}{'H^T X [s]':>12}{'X A^T [s]':>12}"
        f"{'H^T P [s]':>12}{'(XA+HP)/HX':>12}{'flops r(m+n)/mn':>17}",
    ]
    for row in rows:
        lines.append(
            f"{row['label']:<28}{row['tokens']:>6}{row['sketch_rank']:>5}{row['reps']:>5}"
            f"{row['dense_wgrad_s']:>12.4f}{row['projection_s']:>12.4f}{row['sketch_s']:>12.4f}"
            f"{row['logra_over_dense']:>12.3f}{row['flops_ratio']:>17.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--ffn", type=int, default=3072)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--sketch-rank", type=int, default=64)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--json", action="store_true")
    add_kernel_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    rows = run_kernels(args)
    print(json.dumps(rows, indent=2) if args.json else format_kernels(rows, os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
