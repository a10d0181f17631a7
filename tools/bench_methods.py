"""Dense Adam vs LoRA vs LoGRA on the same model and batch: peak memory, state, step time.

    python tools/bench_methods.py                      # default model, CPU, one process each
    python tools/bench_methods.py --json
    python tools/bench_methods.py --procs 2 --tp 2 --sp
    python tools/bench_methods.py --hidden 256 --ffn 1024 --steps 3 --no-kernels
    python tools/bench_methods.py --no-model --kernel-reps 5   # only the backward kernels

Every method trains the same GPT (same initial weights) on the same global batch of random
tokens. Memory is measured with each method in its own process (or torchrun job, with
``--procs``), so that its peak RSS and allocator state are its own; step time in one further
process that holds all methods and steps them in turn, with the order rotating every round, so
that background load on the machine falls on every method alike. The parent prints the
comparison, with the machine's load average. Per method:

* ``peak_bytes``: peak of live tensor storage during one steady-state training step (after a
  warm-up step has allocated the optimizer state) -- counted exactly by
  :class:`megatron_logra.memory.live_tensors.LiveTensorTracker` on CPU, by
  ``torch.cuda.max_memory_allocated`` on a GPU; with its split into persistent state,
  activations (saved for backward) and temporaries at the moment of the peak;
* ``peak_rss_bytes``: the process's peak resident set (interpreter, torch and Megatron included:
  compare it with ``baseline_rss_bytes``, the RSS before the model was built);
* ``state_bytes``: persistent training state by category (:mod:`megatron_logra.mcore.training.state_bytes`);
* ``step_time_s``: median wall time of ``--steps`` steps after ``--warmup`` steps (tracker off),
  ``step_time_min_s``, the fastest step (background load only ever adds time), and
  ``step_cpu_time_s``, the median CPU time of the process per step: on a shared machine with
  ``--threads 1`` it counts the work done, not the time spent waiting for a core (with more
  threads it includes OpenMP's spin-waiting at barriers);
* ``estimate``: the analytic estimator's per-GPU prediction for the same model and layout
  (:mod:`megatron_logra.memory.estimate`, fp32, no activation recompute).

Separately (``--no-kernels`` to skip), the backward cost of a sketch against the dense weight
gradient it replaces: ``H^T (X A^T)`` (plus the projection ``X A^T``) vs ``H^T X``, timed for the
model's target shapes and for a large realistic layer (hidden 4096, ffn 14336, 8 KV groups,
T = 4096, r = 256).

Over 500 lines because it is one benchmark's whole driver: the per-method memory processes, the
rotating timing process, and the one table that compares them (the kernels are bench_kernels).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from bench_kernels import add_kernel_arguments, format_kernels, run_kernels  # noqa: E402

METHODS = ("dense_adam", "lora", "logra")
OPTIMIZER_NAMES = {"dense_adam": "adam", "lora": "lora", "logra": "logra"}
DATA_SEED = 20
LORA_SEED = 7


# ----------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    model = parser.add_argument_group("model and batch")
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--hidden", type=int, default=768)
    model.add_argument("--heads", type=int, default=8)
    model.add_argument("--ffn", type=int, default=3072, help="ffn hidden size (SwiGLU: fc1 is 2x)")
    model.add_argument("--vocab", type=int, default=1024)
    model.add_argument("--seq-length", type=int, default=512)
    model.add_argument("--micro-batch-size", type=int, default=2)
    model.add_argument("--microbatches", type=int, default=1, help="per step and DP rank")
    meth = parser.add_argument_group("methods")
    meth.add_argument("--methods", default=",".join(METHODS),
                      help=f"comma-separated subset of {','.join(METHODS)}")
    meth.add_argument("--sketch-rank", type=int, default=64, help="LoGRA sketch rank r")
    meth.add_argument("--lora-rank", type=int, help="LoRA rank (default: the sketch rank)")
    meth.add_argument("--lora-alpha", type=float, help="LoRA alpha (default: 2 x its rank)")
    meth.add_argument("--lr", type=float, default=1e-4)
    lay = parser.add_argument_group("layout")
    lay.add_argument("--procs", type=int, default=1,
                     help="processes per method (torchrun if > 1)")
    lay.add_argument("--tp", type=int, default=1)
    lay.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    lay.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    run = parser.add_argument_group("timing")
    run.add_argument("--warmup", type=int, default=1, help="untimed steps before measuring")
    run.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    run.add_argument("--threads", type=int,
                     help="torch intra-op threads per process (default: torch's choice)")
    add_kernel_arguments(parser)
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel timings")
    parser.add_argument("--no-model", action="store_true", help="only the kernel timings")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--child", choices=(*METHODS, "timing"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def _check_args(args: argparse.Namespace) -> list[str]:
    methods = [m for m in args.methods.split(",") if m]
    for name in methods:
        if name not in METHODS:
            raise ValueError(f"--methods contains {name!r}; choose from {list(METHODS)}")
    for flag in ("layers", "hidden", "heads", "ffn", "vocab", "seq_length", "micro_batch_size",
                 "microbatches", "sketch_rank", "procs", "tp", "steps", "kernel_reps",
                 "large_reps",
                 "kernel_tokens", "kernel_sketch_rank"):
        value = getattr(args, flag)
        if value < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={value} must be >= 1")
    if args.warmup < 1:
        raise ValueError(f"--warmup={args.warmup} must be >= 1: the first step allocates the "
                         "optimizer state, which the memory step must not include as new")
    if args.procs % args.tp:
        raise ValueError(f"--procs={args.procs} must be a multiple of --tp={args.tp}")
    return methods


def _lora_rank(args: argparse.Namespace) -> int:
    return args.lora_rank or args.sketch_rank


def _lora_alpha(args: argparse.Namespace) -> float:
    return args.lora_alpha if args.lora_alpha is not None else 2.0 * _lora_rank(args)


# ----------------------------------------------------------------------------- one method


def _config(args: argparse.Namespace, method: str, world: int) -> Any:
    from megatron_logra.config import load_config

    dp = world // args.tp
    overrides = [
        f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
        f"model.num_attention_heads={args.heads}", f"model.ffn_hidden_size={args.ffn}",
        f"model.seq_length={args.seq_length}", "model.activation=swiglu",
        "model.normalization=RMSNorm", "model.add_bias_linear=false",
        f"parallel.tp={args.tp}", f"parallel.sp={str(args.sp).lower()}",
        f"parallel.device={args.device}",
        f"optimizer.name={OPTIMIZER_NAMES[method]}", f"optimizer.lr={args.lr}",
        f"lora.lora_rank={_lora_rank(args)}", f"lora.alpha={_lora_alpha(args)}", f"lora.seed={LORA_SEED}",
        "optimizer.clip_grad=1.0", f"logra.sketch_rank={args.sketch_rank}",
        f"train.micro_batch_size={args.micro_batch_size}",
        f"train.global_batch_size={args.micro_batch_size * args.microbatches * dp}",
        f"train.steps={args.warmup + args.steps + 1}",
    ]
    return load_config(None, overrides).resolved(world)


def _microbatches(args: argparse.Namespace, groups: Any, device: torch.device) -> list[Any]:
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


def _estimate(args: argparse.Namespace, cfg: Any, method: str) -> dict[str, float]:
    from megatron_logra.memory.estimate import (
        Layout,
        dense_adam_memory,
        logra_memory,
        lora_memory,
        shape_from_model_config,
    )

    shape = shape_from_model_config(cfg.model, vocab_size=args.vocab, name="bench")
    layout = Layout(tp=args.tp, dp=cfg.parallel.dp, micro_batch_size=args.micro_batch_size,
                    seq_length=args.seq_length, sequence_parallel=args.sp, recompute="none",
                    num_microbatches=args.microbatches)
    distopt = cfg.optimizer.use_distributed_optimizer
    if method == "dense_adam":
        est = dense_adam_memory(shape, layout, precision="fp32", distributed_optimizer=distopt)
    elif method == "lora":
        est = lora_memory(shape, layout, lora_rank=_lora_rank(args), precision="fp32",
                          distributed_optimizer=distopt)
    else:
        est = logra_memory(shape, layout, sketch_rank=args.sketch_rank, precision="fp32",
                           distributed_optimizer=distopt)
    return {"persistent_bytes": est.persistent, "activations_bytes": est.activations,
            "total_bytes": est.total}


def _vm_hwm_bytes() -> int:
    """Peak RSS of this process (VmHWM, kB in /proc/self/status)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line (not Linux?)")


@dataclass
class _MemoryReading:
    peak_bytes: int
    persistent_bytes: int
    peak_by_category: dict[str, int]
    source: str


def _label_persistent(tracker: Any, setup: Any) -> None:
    """Name what lives between steps: weights, LoRA adapters, gradient buffers; the rest of the
    live storage (optimizer state, sketches, projections, caches) is ``other_persistent``."""
    from megatron_logra.mcore.peft.lora import lora_adapters

    params = [p for chunk in setup.model_chunks for p in chunk.parameters()]
    tracker.label(params, "weights")
    adapters = lora_adapters(setup.model_chunks)
    tracker.label([p for a in adapters for p in (a.a, a.b)], "adapters")
    tracker.label((getattr(p, "main_grad", None) for p in params), "grads")
    tracker.label((p.grad for p in params), "grads")
    tracker.label_live("other_persistent")


def _build(args: argparse.Namespace, method: str, groups: Any) -> Any:
    """The method's TrainingSetup on a freshly built model (the same initial weights for all)."""
    from megatron_logra.mcore.models.gpt import build_model_chunks
    from megatron_logra.mcore.training.setup import setup_training

    cfg = _config(args, method, groups.world_size)
    chunks = build_model_chunks(cfg, groups, vocab_size=args.vocab)
    return setup_training(cfg, chunks, groups)


def _stepper(args: argparse.Namespace, setup: Any, groups: Any) -> Any:
    from megatron_logra.mcore.training.step import train_step

    batch = _microbatches(args, groups, groups.device)

    def step() -> float:
        result = train_step(setup, batch, groups=groups, seq_length=args.seq_length,
                            micro_batch_size=args.micro_batch_size)
        if groups.device.type == "cuda":
            torch.cuda.synchronize()
        return result.loss

    return step


def _gather(mine: dict[str, Any], groups: Any) -> list[dict[str, Any]]:
    import torch.distributed as dist

    everyone: list[dict[str, Any] | None] = [None] * groups.world_size
    dist.all_gather_object(everyone, mine)
    return [r for r in everyone if r is not None]


def _measure_memory(args: argparse.Namespace, method: str, groups: Any) -> dict[str, Any]:
    """One method in this process: build, warm up, then one step with memory accounting."""
    from megatron_logra.mcore.training.state_bytes import persistent_state_bytes
    from megatron_logra.memory.live_tensors import LiveTensorTracker
    from megatron_logra.train.metrics import current_rss_bytes

    on_gpu = groups.device.type == "cuda"
    baseline_rss = current_rss_bytes()
    tracker = None if on_gpu else LiveTensorTracker()
    if tracker is not None:
        tracker.__enter__()
    try:
        setup = _build(args, method, groups)
        step = _stepper(args, setup, groups)
        losses = [step() for _ in range(args.warmup)]
        gc.collect()
        if tracker is not None:
            _label_persistent(tracker, setup)
            persistent = tracker.live_bytes
            tracker.reset_peak()
            losses.append(step())
            report = tracker.report()
            reading = _MemoryReading(report.peak_bytes, persistent, report.peak_by_category,
                                     "live-tensor tracker (exact, CPU)")
        else:
            persistent = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            losses.append(step())
            peak = torch.cuda.max_memory_allocated()
            reading = _MemoryReading(peak, persistent,
                                     {"persistent": persistent, "step": peak - persistent},
                                     "torch.cuda.max_memory_allocated")
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    ranks = _gather({
        "peak_bytes": reading.peak_bytes,
        "persistent_bytes": reading.persistent_bytes,
        "peak_by_category": reading.peak_by_category,
        "peak_rss_bytes": _vm_hwm_bytes(),
        "baseline_rss_bytes": baseline_rss,
        "state_bytes": persistent_state_bytes(setup),
    }, groups)
    # The most loaded rank is what has to fit on one device.
    worst = max(ranks, key=lambda r: r["peak_bytes"])
    return {
        "method": method,
        "memory_source": reading.source,
        "peak_bytes": worst["peak_bytes"],
        "persistent_bytes": worst["persistent_bytes"],
        "peak_by_category": worst["peak_by_category"],
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "baseline_rss_bytes": max(r["baseline_rss_bytes"] for r in ranks),
        "state_bytes": max((r["state_bytes"] for r in ranks), key=lambda s: sum(s.values())),
        "losses": losses,
        "estimate": _estimate(args, _config(args, method, groups.world_size), method),
        "world_size": groups.world_size,
        "device": str(groups.device),
        "torch_threads": torch.get_num_threads(),
    }


def _measure_time(args: argparse.Namespace, methods: list[str], groups: Any) -> dict[str, Any]:
    """All methods in one process, stepped in turn (the order rotating every round), so that
    the machine's background load falls on each method alike."""
    steps = {m: _stepper(args, _build(args, m, groups), groups) for m in methods}
    for method in methods:
        for _ in range(args.warmup):
            steps[method]()
    wall: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    for round_index in range(args.steps):
        shift = round_index % len(methods)
        for method in methods[shift:] + methods[:shift]:
            start, start_cpu = time.perf_counter(), time.process_time()
            steps[method]()
            cpu[method].append(time.process_time() - start_cpu)
            wall[method].append(time.perf_counter() - start)
    ranks = _gather({"wall": wall, "cpu": cpu}, groups)
    # The ranks synchronise every step: a step takes as long as its slowest rank.
    return {kind: {m: [max(r[kind][m][i] for r in ranks) for i in range(args.steps)]
                   for m in methods} for kind in ("wall", "cpu")}


def _child_main(args: argparse.Namespace, methods: list[str]) -> int:
    from megatron_logra.mcore.process_groups import (
        destroy_parallel,
        init_parallel,
        world_size_from_env,
    )

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    groups = init_parallel(_config(args, "dense_adam", world_size_from_env()))
    try:
        if args.child == "timing":
            result: dict[str, Any] = _measure_time(args, methods, groups)
        else:
            result = _measure_memory(args, args.child, groups)
    finally:
        destroy_parallel()
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.result).write_text(json.dumps(result))
    return 0


def _launch(args: argparse.Namespace, method: str, argv: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / f"{method}.json"
        tail = [str(Path(__file__).resolve()), *argv, "--child", method, "--result", str(result)]
        if args.procs > 1:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc_per_node={args.procs}", *tail]
        else:
            command = [sys.executable, *tail]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{method} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                               f"{done.stderr[-5000:]}")
        return json.loads(result.read_text())


# ----------------------------------------------------------------------------- report


def _mib(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def format_methods(results: dict[str, dict[str, Any]], args: argparse.Namespace,
                   load: tuple[float, float, float]) -> str:
    names = list(results)
    any_result = results[names[0]]
    lines = [
        f"model: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn} (SwiGLU), "
        f"{args.heads} heads, vocab {args.vocab}; batch {args.microbatches} x "
        f"{args.micro_batch_size} x {args.seq_length} tokens per DP rank; tp={args.tp} "
        f"sp={'on' if args.sp else 'off'} on {args.procs} process(es), "
        f"{any_result['device']}, {any_result['torch_threads']} threads each",
        f"methods: dense Adam | LoRA rank {_lora_rank(args)} (alpha {_lora_alpha(args):g}, base "
        f"frozen, Adam) | LoGRA sketch rank {args.sketch_rank} (library: RowAdam on targets, "
        "Adam on the rest); fp32",
        f"memory: {any_result['memory_source']}; time: {args.steps} steps per method after "
        f"{args.warmup} warm-up, methods in turn; load average {load[0]:.2f} on "
        f"{os.cpu_count()} CPUs (1 minute)",
        "",
        f"{'per device [MiB]':<40}" + "".join(f"{n:>14}" for n in names),
    ]

    def row(label: str, values: list[str]) -> None:
        lines.append(f"{label:<40}" + "".join(f"{v:>14}" for v in values))

    row("peak live tensors (measured)", [_mib(results[n]["peak_bytes"]) for n in names])
    row("  estimate: total", [_mib(results[n]["estimate"]["total_bytes"]) for n in names])
    row("persistent (measured, step start)", [_mib(results[n]["persistent_bytes"])
                                              for n in names])
    row("  state_bytes (weights..projections)",
        [_mib(sum(results[n]["state_bytes"].values())) for n in names])
    row("  estimate: persistent", [_mib(results[n]["estimate"]["persistent_bytes"])
                                   for n in names])
    categories = sorted({c for n in names for c in results[n]["peak_by_category"]})
    for category in categories:
        row(f"  at peak: {category}", [_mib(results[n]["peak_by_category"].get(category, 0))
                                       for n in names])
    row("  estimate: activations", [_mib(results[n]["estimate"]["activations_bytes"])
                                    for n in names])
    row("peak RSS", [_mib(results[n]["peak_rss_bytes"]) for n in names])
    row("  RSS before the model", [_mib(results[n]["baseline_rss_bytes"]) for n in names])
    lines.append(f"{'step time [s] (median)':<40}"
                 + "".join(f"{results[n]['step_time_s']:>14.3f}" for n in names))
    lines.append(f"{'step time [s] (fastest)':<40}"
                 + "".join(f"{results[n]['step_time_min_s']:>14.3f}" for n in names))
    lines.append(f"{'step time [s] (slowest)':<40}"
                 + "".join(f"{max(results[n]['step_times_s']):>14.3f}" for n in names))
    lines.append(f"{'step CPU time [s] (median)':<40}"
                 + "".join(f"{results[n]['step_cpu_time_s']:>14.3f}" for n in names))
    if "logra" in results:
        lines.append("")
        for other in ("dense_adam", "lora"):
            if other in results:
                lines.append(_ratio_line(results["logra"], results[other], other))
    return "\n".join(lines)


def ratios(logra: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    return {
        "peak_bytes": logra["peak_bytes"] / other["peak_bytes"],
        "persistent_bytes": logra["persistent_bytes"] / other["persistent_bytes"],
        "peak_rss_bytes": logra["peak_rss_bytes"] / other["peak_rss_bytes"],
        "step_time_s": logra["step_time_s"] / other["step_time_s"],
        "step_time_min_s": logra["step_time_min_s"] / other["step_time_min_s"],
        "step_cpu_time_s": logra["step_cpu_time_s"] / other["step_cpu_time_s"],
        "estimate_total_bytes": (logra["estimate"]["total_bytes"]
                                 / other["estimate"]["total_bytes"]),
    }


def _ratio_line(logra: dict[str, Any], other: dict[str, Any], name: str) -> str:
    r = ratios(logra, other)
    return (f"LoGRA / {name}: peak {r['peak_bytes']:.3f} (estimate "
            f"{r['estimate_total_bytes']:.3f}), persistent {r['persistent_bytes']:.3f}, peak RSS "
            f"{r['peak_rss_bytes']:.3f}, step time {r['step_time_s']:.3f} (median) / "
            f"{r['step_time_min_s']:.3f} (fastest), step CPU time {r['step_cpu_time_s']:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:
        methods = _check_args(args)
    except ValueError as error:
        parser.error(str(error))
    if args.child:
        return _child_main(args, methods)
    out: dict[str, Any] = {}
    if not args.no_model:
        results = {m: _launch(args, m, argv) for m in methods}
        times = _launch(args, "timing", argv)
        for method, result in results.items():
            result["step_times_s"] = times["wall"][method]
            result["step_time_s"] = statistics.median(times["wall"][method])
            result["step_time_min_s"] = min(times["wall"][method])
            result["step_cpu_times_s"] = times["cpu"][method]
            result["step_cpu_time_s"] = statistics.median(times["cpu"][method])
        out["load_average"] = os.getloadavg()
        out["methods"] = results
        if "logra" in results:
            out["ratios"] = {f"logra_over_{o}": ratios(results["logra"], results[o])
                             for o in ("dense_adam", "lora") if o in results}
        if not args.json:
            print(format_methods(results, args, out["load_average"]), flush=True)
    if not args.no_kernels:
        out["kernels"] = run_kernels(args)
        if not args.json:
            print("\n" + format_kernels(out["kernels"], os.getloadavg()))
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
