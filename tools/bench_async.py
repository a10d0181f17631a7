"""Rollouts that overlap training: the demo-sized RL job with a separate engine at
``rollout.max_staleness`` 0 (synchronous) and 1 (one step off policy), in one command.

    python tools/bench_async.py                    # throughput: steps/s, phases, idle time
    python tools/bench_async.py --learning         # and the learning comparison (long)

The job is ``configs/demo_rl_cpu.yaml`` from the demo's warm start (``make demo``'s
``runs/demo/sft/model``; written first if absent) with one trainer rank (TP=1) pinned to one core
and the Megatron engine (TP=1) pinned to another (``rollout.cpus``), one thread each: the
paper's trainer/engine split on two cores. The machine's load average is printed beside every
timing: on a shared machine the times are noisy, so the two settings run in alternating rounds
and the ratio is of medians.

**Throughput** (each round: a short run at staleness 0, then one at 1; the first
``--warmup`` steps of each are left out): steps per second; per step the phases -- the engine's
generation of the batch, the trainer's rewards and batching, its update (loss, KL probe,
optimizer), the policy sync -- and the idle time of each side: the trainer blocked on the engine,
the engine without a call. The ideal speedup of a perfect overlap follows from the synchronous
run's phases: its step time over the larger of the engine's busy time and the trainer's own work
(step time minus its idle time).

**Learning** (``--learning``): ``--learning-steps`` steps at each staleness from the same warm
start, evaluated on the validation split (``rl.eval.split=validation``: settings are chosen
there, not on the test problems) before and after; the staleness-1 run's final greedy accuracy
against the synchronous run's, paired problem by problem (the standard error counts the
problems whose outcome differs between the two).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_logra.rl.eval_answers import (  # noqa: E402
    eval_answers_path,
    paired_greedy_change,
    read_eval_answers,
)
from megatron_logra.train.metrics import read_metrics  # noqa: E402
from tools.demo_cpu import (  # noqa: E402
    CONFIG,
    DATA_DIR,
    SFT_OVERRIDES,
    _torchrun,
    ensure_dataset,
)

OUT_DIR = REPO / "runs" / "bench_async"
WARM_START = REPO / "runs" / "demo" / "sft"
TRAINER_CORE, ENGINE_CORE = 0, 1
STALENESS = (0, 1)
# One trainer rank, the Megatron engine at TP=1 on its own core; the demo's RL settings
# otherwise (64 prompts, 6 new tokens, paper mode with the KL step control).
COMMON: tuple[str, ...] = (
    "parallel.tp=1", "rollout.placement=separate", "rollout.engine=megatron", "rollout.tp=1",
    f"rollout.cpus=[{ENGINE_CORE}]",
)
# Throughput runs evaluate nothing (the evaluation is not a training phase).
THROUGHPUT: tuple[str, ...] = ("rl.eval.interval=0", "rl.eval.prompts=1", "rl.eval.samples=1")
# Learning runs: every validation problem, greedy and one sample each, before and after.
LEARNING: tuple[str, ...] = ("rl.eval.interval=0", "rl.eval.split=validation",
                             "rl.eval.prompts=1000", "rl.eval.samples=1")
PHASES = (
    ("step", "step_time_s"),
    ("generation (engine)", "generation_time_s"),
    ("rewards + batching", None),  # rollout_time_s - rollout_wait_s
    ("update", "update_time_s"),
    ("sync", "sync_time_s"),
    ("trainer idle", "trainer_idle_s"),
    ("engine busy", "engine_busy_s"),
    ("engine idle", "engine_idle_s"),
)


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} on {os.cpu_count()} cores"


def run_rl(run_dir: Path, overrides: list[str], label: str) -> list[dict]:
    """One RL run, its trainer pinned to TRAINER_CORE; the step records."""
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            "-m", "megatron_logra", "rl", str(CONFIG), *overrides, f"run.dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    print(f"\n=== {label} ({load_average()})\n$ taskset -c {TRAINER_CORE} torchrun "
          f"--nproc_per_node=1 -m megatron_logra rl {CONFIG.relative_to(REPO)} "
          f"{' '.join(overrides)}", flush=True)
    started = time.perf_counter()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        subprocess.run(["taskset", "-c", str(TRAINER_CORE), *args], cwd=REPO, env=env,
                       check=True, stdout=log, stderr=subprocess.STDOUT)
    print(f"=== {label}: {time.perf_counter() - started:.0f} s ({load_average()})", flush=True)
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "staleness" in r]


def phase(record: dict, key: str | None) -> float:
    if key is None:
        return record["rollout_time_s"] - record["rollout_wait_s"]
    return record[key]


def throughput(args, base: list[str]) -> dict:
    steps: dict[int, list[dict]] = {s: [] for s in STALENESS}
    for round_ in range(args.rounds):
        for staleness in STALENESS:
            run_dir = args.out / f"throughput_s{staleness}_r{round_}"
            records = run_rl(run_dir, [*base, *THROUGHPUT, f"train.steps={args.steps}",
                                       f"rollout.max_staleness={staleness}",
                                       f"rl.seed={round_}"],
                             f"throughput, staleness {staleness}, round {round_ + 1}")
            # The last step generates nothing ahead: left out with the warm-up.
            steps[staleness] += records[args.warmup:-1]
    print(f"\nper step, median over {len(steps[0])} steps per setting ({args.rounds} round(s) of "
          f"{args.steps} steps, first {args.warmup} and last left out); {load_average()}")
    print(f"{'':>22} " + " ".join(f"{f'staleness {s}':>12}" for s in STALENESS))
    medians = {s: {name: statistics.median(phase(r, key) for r in steps[s])
                   for name, key in PHASES} for s in STALENESS}
    for name, _ in PHASES:
        print(f"{name + ' (s)':>22} " + " ".join(f"{medians[s][name]:>12.3f}"
                                                  for s in STALENESS))
    rate = {s: len(steps[s]) / sum(r["step_time_s"] for r in steps[s]) for s in STALENESS}
    print(f"{'steps/s':>22} " + " ".join(f"{rate[s]:>12.3f}" for s in STALENESS))
    sync = medians[0]
    trainer_work = sync["step"] - sync["trainer idle"]
    ideal = sync["step"] / max(sync["engine busy"], trainer_work)
    speedup = rate[1] / rate[0]
    print(f"\nspeedup at staleness 1: {speedup:.2f}x steps/s (goal >= 1.3x); ideal from the "
          f"synchronous phases: {ideal:.2f}x = step {sync['step']:.3f} s / max(engine busy "
          f"{sync['engine busy']:.3f} s, trainer work {trainer_work:.3f} s)")
    return {"steps_per_s": rate, "medians": medians, "speedup": speedup, "ideal": ideal,
            "load": load_average()}


def learning(args, base: list[str]) -> dict:
    runs = {}
    for staleness in STALENESS:
        run_dir = args.out / f"learning_s{staleness}"
        run_rl(run_dir, [*base, *LEARNING, f"train.steps={args.learning_steps}",
                         f"rollout.max_staleness={staleness}"],
               f"learning, staleness {staleness}")
        runs[staleness] = run_dir
    final = {}
    print(f"\ngreedy accuracy on the validation split, {args.learning_steps} RL steps from the "
          "warm start")
    for staleness, run_dir in runs.items():
        records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval_greedy" in r]
        first, last = records[0], records[-1]
        before = read_eval_answers(eval_answers_path(run_dir, first["step"]))
        after = read_eval_answers(eval_answers_path(run_dir, last["step"]))
        gain = paired_greedy_change(before, after)
        final[staleness] = after
        print(f"  staleness {staleness}: {gain.before:.3f} -> {gain.after:.3f} "
              f"({gain.change:+.3f} +- {gain.standard_error:.3f} SE)")
    versus = paired_greedy_change(final[0], final[1])
    within = abs(versus.change) <= versus.standard_error
    print(f"  staleness 1 - synchronous, final greedy accuracy paired by problem: "
          f"{versus.change:+.3f} +- {versus.standard_error:.3f} SE ({versus.gained} problems "
          f"only staleness 1 solves, {versus.lost} only the synchronous run): "
          f"{'within' if within else 'NOT within'} one paired SE")
    return {"difference": versus.change, "standard_error": versus.standard_error,
            "within_one_se": within}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--steps", type=int, default=12, help="steps per throughput run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out")
    parser.add_argument("--learning", action="store_true", help="also the learning comparison")
    parser.add_argument("--learning-steps", type=int, default=200)
    parser.add_argument("--warm-start", type=Path, default=WARM_START,
                        help="the warm start's run directory (its model/ is loaded)")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    if args.steps < args.warmup + 2:
        parser.error("--steps must leave at least one step after --warmup and the last")
    if len(os.sched_getaffinity(0)) < 2 or {TRAINER_CORE, ENGINE_CORE} - os.sched_getaffinity(0):
        raise SystemExit(f"needs cores {TRAINER_CORE} and {ENGINE_CORE}")
    started = time.perf_counter()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    ensure_dataset()
    model = args.warm_start.resolve() / "model"
    if not model.is_dir():
        _torchrun("sft", [f"data.dir={DATA_DIR}", *SFT_OVERRIDES,
                          f"run.dir={args.warm_start.resolve()}"], "the demo's warm start")
    base = [f"data.dir={DATA_DIR}", f"model.init_checkpoint={model}", *COMMON]
    report = {"throughput": throughput(args, base)}
    if args.learning:
        report["learning"] = learning(args, base)
    (args.out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\nbench wall time {time.perf_counter() - started:.0f} s; {load_average()}")


if __name__ == "__main__":
    main()
