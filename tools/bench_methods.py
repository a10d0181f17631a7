"""Dense Adam vs LoRA vs LoGRA on the same model and batch: peak memory, state, step time.

    python tools/bench_methods.py                      # default model, CPU, one process each
    python tools/bench_methods.py --json
    python tools/bench_methods.py --procs 2 --tp 2 --sp
    python tools/bench_methods.py --hidden 256 --ffn 1024 --steps 3 --no-kernels
    python tools/bench_methods.py --no-model --kernel-reps 5   # only the backward kernels
    python tools/bench_methods.py --hidden 1024 --layers 8 --ffn 4096 --micro-batch-size 1 \
        --seq-length 2048 --recompute selective --methods dense_adam,lora,logra,logra_paper
    python tools/bench_methods.py --dtype bf16 --master-weights dp_sharded,remainder,host

Methods (``--methods``): ``dense_adam``, ``lora``, ``logra`` (library mode; these three by
default) and ``logra_paper`` (paper mode with the predicted-KL step control: non-targets frozen,
the probe's forward-mode JVP before the merge and the realised-KL forward after it, as
``train``/``rl`` run them). With ``--master-weights``
naming several modes, every LoGRA method runs once per mode (columns ``logra@remainder``, ...).

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
* ``host_bytes``: LoGRA's host masters (``logra.master_weights=host``), which live beside the
  device and are in no device figure above (on CPU the two are the same memory);
* ``estimate``: the analytic estimator's per-GPU prediction for the same model, layout,
  precision, master mode and recompute mode (:mod:`megatron_logra.memory.estimate`);
* LoGRA: ``merge_time_s``, the median wall time of the merge (masters and weights);
  ``logra_paper``: ``kl_probe_time_s`` (the step scale: the probe's JVP and its predicted KL),
  ``kl_realised_time_s`` (the realised-KL forward) and their ``kl_share`` of the step time.

Separately (``--no-kernels`` to skip), the backward cost of a sketch against the dense weight
gradient it replaces: ``H^T (X A^T)`` (plus the projection ``X A^T``) vs ``H^T X``, timed for the
model's target shapes and for a large realistic layer (hidden 4096, ffn 14336, 8 KV groups,
T = 4096, r = 256).

The per-method memory processes and the rotating timing process are here; the table that
compares them is bench_methods_report, the kernels are bench_kernels.
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
from bench_methods_report import all_ratios, format_methods, is_logra  # noqa: E402
from bench_methods_run import (  # noqa: E402
    METHODS,
    build,
    built_settings,
    estimate,
    lora_alpha,
    lora_rank,
    method_config,
    stepper,
)

from megatron_logra.config.model import ATTENTIONS, PARAMS_DTYPES, RECOMPUTES  # noqa: E402
from megatron_logra.config.optim import MASTER_WEIGHTS  # noqa: E402

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
    model.add_argument("--recompute", choices=RECOMPUTES, default="none",
                       help="model.recompute (full: Megatron's uniform method, 1 layer a group)")
    model.add_argument("--attention", choices=ATTENTIONS, default="sdpa", help="model.attention")
    model.add_argument("--dtype", choices=PARAMS_DTYPES, default="fp32",
                       help="model.params_dtype (bf16: Megatron mixed precision)")
    moe = parser.add_argument_group("mixture of experts (docs/moe.md)")
    moe.add_argument("--moe-experts", type=int, default=0,
                     help="model.num_moe_experts: routed experts per layer (0: a dense GPT)")
    moe.add_argument("--moe-topk", type=int, default=2, help="model.moe_router_topk")
    moe.add_argument("--moe-ffn", type=int,
                     help="model.moe_ffn_hidden_size: one expert's FFN width (default --ffn)")
    moe.add_argument("--moe-shared-ffn", type=int,
                     help="model.moe_shared_expert_ffn_hidden_size (default: no shared expert)")
    moe.add_argument("--ep", type=int, default=1, help="parallel.ep: expert parallelism")
    meth = parser.add_argument_group("methods")
    # logra_paper is asked for by name: its probe passes make the default run (and the GPU
    # check's memory section, which budgets four processes) longer.
    meth.add_argument("--methods", default="dense_adam,lora,logra",
                      help=f"comma-separated subset of {','.join(METHODS)}")
    meth.add_argument("--sketch-rank", type=int, default=64, help="LoGRA sketch rank r")
    meth.add_argument("--lora-rank", type=int, help="LoRA rank (default: the sketch rank)")
    meth.add_argument("--lora-alpha", type=float, help="LoRA alpha (default: 2 x its rank)")
    meth.add_argument("--lr", type=float, default=1e-4)
    meth.add_argument("--master-weights",
                      help="logra.master_weights of the LoGRA methods, or several, comma-"
                      f"separated (each a column); from {','.join(MASTER_WEIGHTS)}; default: "
                      "the config's (auto)")
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
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a method key, or "timing"
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def _check_args(args: argparse.Namespace) -> list[str]:
    """The method keys to run: ``dense_adam``, ``lora``, and each LoGRA method as is (one master
    mode or the config's) or as ``logra@<mode>`` per mode of ``--master-weights``."""
    methods = [m for m in args.methods.split(",") if m]
    for name in methods:
        if name not in METHODS:
            raise ValueError(f"--methods contains {name!r}; choose from {list(METHODS)}")
    modes = [m for m in (args.master_weights or "").split(",") if m]
    for mode in modes:
        if mode not in MASTER_WEIGHTS:
            raise ValueError(f"--master-weights contains {mode!r}; choose from "
                             f"{list(MASTER_WEIGHTS)}")
    if len(modes) > 1:
        methods = [f"{m}@{mode}" if is_logra(m) else m for m in methods
                   for mode in (modes if is_logra(m) else [None])]
    for flag in ("layers", "hidden", "heads", "ffn", "vocab", "seq_length", "micro_batch_size",
                 "microbatches", "sketch_rank", "procs", "tp", "ep", "steps", "kernel_reps",
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
    if args.moe_experts < 0:
        raise ValueError(f"--moe-experts={args.moe_experts} must be >= 0 (0: a dense GPT)")
    if args.moe_experts and "lora" in methods:
        # The config refuses it too (optimizer.name=lora with model.num_moe_experts), but after
        # a process per method was started: say it before anything runs.
        raise ValueError("--methods contains lora, which has no expert targets (LoRA on routed "
                         "experts is not built, docs/moe.md); drop it with --moe-experts, e.g. "
                         "--methods dense_adam,logra")
    return methods


# ----------------------------------------------------------------------------- one method


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


HOST = "host_masters"
"""The tracker's category of LoGRA's host masters: beside the device, in no device figure."""


def _host_tensors(setup: Any) -> list[torch.Tensor]:
    if setup.logra is None:
        return []
    return [t for master in setup.logra.masters.values() for t in master.host_tensors()]


def _label_persistent(tracker: Any, setup: Any) -> None:
    """Name what lives between steps: host masters, weights, LoRA adapters, gradient buffers; the
    rest of the live storage (optimizer state, sketches, projections, caches) is
    ``other_persistent``."""
    from megatron_logra.mcore.peft.lora import lora_adapters

    tracker.label(_host_tensors(setup), HOST)
    params = [p for chunk in setup.model_chunks for p in chunk.parameters()]
    tracker.label(params, "weights")
    adapters = lora_adapters(setup.model_chunks)
    tracker.label([p for a in adapters for p in (a.a, a.b)], "adapters")
    tracker.label((getattr(p, "main_grad", None) for p in params), "grads")
    tracker.label((p.grad for p in params), "grads")
    tracker.label_live("other_persistent")


def _gather(mine: dict[str, Any], groups: Any) -> list[dict[str, Any]]:
    import torch.distributed as dist

    everyone: list[dict[str, Any] | None] = [None] * groups.world_size
    dist.all_gather_object(everyone, mine)
    return [r for r in everyone if r is not None]


def _measure_memory(args: argparse.Namespace, key: str, groups: Any) -> dict[str, Any]:
    """One method in this process: build, warm up, then one step with memory accounting."""
    from megatron_logra.mcore.training.state_bytes import DEVICE_CATEGORIES, persistent_state_bytes
    from megatron_logra.memory.live_tensors import LiveTensorTracker
    from megatron_logra.train.metrics import current_rss_bytes

    on_gpu = groups.device.type == "cuda"
    baseline_rss = current_rss_bytes()
    tracker = None if on_gpu else LiveTensorTracker()
    if tracker is not None:
        tracker.__enter__()
    try:
        cfg, setup = build(args, key, groups)
        step = stepper(args, cfg, setup, groups)
        losses = [step()[0] for _ in range(args.warmup)]
        gc.collect()
        if tracker is not None:
            _label_persistent(tracker, setup)
            persistent = tracker.live_bytes
            tracker.reset_peak()
            losses.append(step()[0])
            report = tracker.report()
            # Host masters live through the whole step (merged in place): the device's peak is
            # the peak of everything else.
            by_category = dict(report.peak_by_category)
            host = by_category.pop(HOST, 0)
            reading = _MemoryReading(report.peak_bytes - host,
                                     persistent - report.live_by_category.get(HOST, 0),
                                     by_category, "live-tensor tracker (exact, CPU)")
        else:
            # Pinned host masters are not in the CUDA allocator's figures.
            persistent = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            losses.append(step()[0])
            peak = torch.cuda.max_memory_allocated()
            reading = _MemoryReading(peak, persistent,
                                     {"persistent": persistent, "step": peak - persistent},
                                     "torch.cuda.max_memory_allocated")
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    state = persistent_state_bytes(setup)
    ranks = _gather({
        "peak_bytes": reading.peak_bytes,
        "persistent_bytes": reading.persistent_bytes,
        "peak_by_category": reading.peak_by_category,
        "peak_rss_bytes": _vm_hwm_bytes(),
        "baseline_rss_bytes": baseline_rss,
        "state_bytes": state,
        "device_state_bytes": sum(state[c] for c in DEVICE_CATEGORIES),
        "host_bytes": sum(v for c, v in state.items() if c not in DEVICE_CATEGORIES),
    }, groups)
    # The most loaded rank is what has to fit on one device.
    worst = max(ranks, key=lambda r: r["peak_bytes"])
    fullest = max(ranks, key=lambda r: r["device_state_bytes"])
    return {
        "method": key,
        "config": built_settings(cfg, setup),
        "memory_source": reading.source,
        "peak_bytes": worst["peak_bytes"],
        "persistent_bytes": worst["persistent_bytes"],
        "peak_by_category": worst["peak_by_category"],
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "baseline_rss_bytes": max(r["baseline_rss_bytes"] for r in ranks),
        "state_bytes": fullest["state_bytes"],
        "device_state_bytes": fullest["device_state_bytes"],
        "host_bytes": max(r["host_bytes"] for r in ranks),
        "losses": losses,
        "estimate": estimate(args, cfg, key),
        "world_size": groups.world_size,
        "device": str(groups.device),
        "torch_threads": torch.get_num_threads(),
    }


def _measure_time(args: argparse.Namespace, methods: list[str], groups: Any) -> dict[str, Any]:
    """All methods in one process, stepped in turn (the order rotating every round), so that
    the machine's background load falls on each method alike."""
    steps = {m: stepper(args, *build(args, m, groups), groups) for m in methods}
    for method in methods:
        for _ in range(args.warmup):
            steps[method]()
    times: dict[str, dict[str, list[float]]] = {m: {} for m in methods}
    for round_index in range(args.steps):
        shift = round_index % len(methods)
        for method in methods[shift:] + methods[:shift]:
            start, start_cpu = time.perf_counter(), time.process_time()
            _, parts = steps[method]()
            cpu = time.process_time() - start_cpu
            for kind, seconds in {"wall": time.perf_counter() - start, "cpu": cpu,
                                  **parts}.items():
                times[method].setdefault(kind, []).append(seconds)
    ranks = _gather(times, groups)
    # The ranks synchronise every step: a step (or a collective part of it) takes as long as
    # its slowest rank.
    return {m: {kind: [max(r[m][kind][i] for r in ranks) for i in range(args.steps)]
                for kind in times[m]} for m in methods}


def _child_main(args: argparse.Namespace, methods: list[str]) -> int:
    from megatron_logra.mcore.process_groups import (
        destroy_parallel,
        init_parallel,
        world_size_from_env,
    )

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    groups = init_parallel(method_config(args, "dense_adam", world_size_from_env()))
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


def _add_times(result: dict[str, Any], times: dict[str, list[float]]) -> None:
    median = statistics.median
    result["step_times_s"] = times["wall"]
    result["step_time_s"] = median(times["wall"])
    result["step_time_min_s"] = min(times["wall"])
    result["step_cpu_times_s"] = times["cpu"]
    result["step_cpu_time_s"] = median(times["cpu"])
    for part in ("merge", "kl_probe", "kl_realised"):
        if part in times:
            result[f"{part}_time_s"] = median(times[part])
    if "kl_probe" in times:
        # Per step, then the median: the parts and their step share the same load.
        shares = [(p + r) / w for p, r, w in zip(times["kl_probe"], times["kl_realised"],
                                                 times["wall"], strict=True)]
        result["kl_share"] = median(shares)


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
    for key in methods:
        try:  # the config's own checks, before any process is started
            method_config(args, key, args.procs)
        except ValueError as error:
            parser.error(f"{key}: {error}")
    out: dict[str, Any] = {}
    if not args.no_model:
        results = {m: _launch(args, m, argv) for m in methods}
        times = _launch(args, "timing", argv)
        for method, result in results.items():
            _add_times(result, times[method])
        out["load_average"] = os.getloadavg()
        out["methods"] = results
        out["ratios"] = all_ratios(results)
        if not args.json:
            print(format_methods(results, args, lora_rank(args), lora_alpha(args),
                                 out["load_average"]), flush=True)
    if not args.no_kernels:
        out["kernels"] = run_kernels(args)
        if not args.json:
            print("\n" + format_kernels(out["kernels"], os.getloadavg()))
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
