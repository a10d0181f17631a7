"""How many probe responses the predicted-KL step control needs: the probe-size study on the demo.

    python tools/probe_size_study.py                        # 30 RL steps, probes of 1..16
    python tools/probe_size_study.py --steps 60 --sizes 1,2,4,8,16,32 --json

The CPU demo's RL (configs/demo_rl_cpu.yaml: paper mode under predicted-KL step control, from
the demo's supervised warm start, which this runs first when it is missing) on one process, with
every response of each step in the probe (``logra.kl_control.probe_responses`` = the batch), so
that one forward-mode pass gives every response's predicted-KL sum and one realised pass every
response's realised KL. Alpha is the controller's, from the whole batch.

For a probe of n responses each step's responses are cut into disjoint groups of n (in batch
order, as the trainer takes the first n). A group's prediction of the update that was applied,
``alpha^2 m_group``, is compared with the KL the update realised on the whole batch -- what the
step did to the policy on this step's data:

    r = realised KL per token on the batch / (alpha^2 x predicted KL per token on the group)

The spread of ``log r`` over groups and steps says how far a probe of n responses misjudges the
step it sizes (the controller then over- or undershoots its budget by that factor); its mean, the
bias. ``r_self`` compares a group's prediction with the KL realised on the group's own tokens:
the Fisher form's second-order accuracy, which the probe size does not change.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

CONFIG = REPO / "configs" / "demo_rl_cpu.yaml"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sizes", default="1,2,4,8,16", help="probe sizes (responses)")
    parser.add_argument("--init-checkpoint", type=Path,
                        help="the warm start (default: the demo's, made if missing)")
    parser.add_argument("--demo-out", type=Path, default=REPO / "runs" / "demo",
                        help="where the demo's runs are (its sft/ is the warm start)")
    parser.add_argument("--seed", type=int, default=None, help="rl.seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    return parser


def warm_start(args: argparse.Namespace) -> Path:
    """The demo's supervised warm start: its data and SFT run (tools/demo_cpu.py's first two
    stages) when they are not there yet."""
    import demo_cpu

    # Progress (the SFT run's too) goes to stderr: stdout is the result (--json).
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        demo_cpu.ensure_dataset()
        model = args.demo_out / "sft" / "model"
        if not model.is_dir():
            sft = [f"data.dir={demo_cpu.DATA_DIR}", *demo_cpu.SFT_OVERRIDES,
                   f"run.dir={args.demo_out / 'sft'}"]
            demo_cpu._torchrun("sft", sft, "supervised warm start (dense Adam)")
        sys.stdout.flush()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return model


def run_steps(args: argparse.Namespace, init: Path) -> list[dict[str, Any]]:
    """Per RL step: alpha and every response's predicted and realised (sum, count)."""
    import demo_cpu
    import torch

    from megatron_logra.config import load_config
    from megatron_logra.mcore.process_groups import destroy_parallel, init_parallel
    from megatron_logra.train.rl.job import RLJob

    torch.set_num_threads(args.threads)
    base = load_config(CONFIG)
    batch = base.rl.prompts_per_step * base.rl.samples_per_prompt
    with tempfile.TemporaryDirectory(prefix="probe_size_") as run_dir:
        overrides = [
            "parallel.tp=1", f"data.dir={demo_cpu.DATA_DIR}", f"model.init_checkpoint={init}",
            f"run.dir={run_dir}", f"train.steps={args.steps}",
            f"logra.kl_control.probe_responses={batch}",
            *([f"rl.seed={args.seed}"] if args.seed is not None else []),
        ]
        cfg = load_config(CONFIG, overrides).resolved(1, "rl")
        groups = init_parallel(cfg)
        steps = []
        try:
            job = RLJob(cfg, groups)
            try:
                for step in range(args.steps):
                    record = job.step(step)
                    control = job.setup.kl_control
                    steps.append({
                        "alpha": control.decision.alpha,
                        "kl_realized": record["kl_realized"],
                        "predicted": [(float(s.total), float(s.count))
                                      for s in control.predicted_piece_sums],
                        "realised": [(float(s.total), float(s.count))
                                     for s in control.realised_piece_sums],
                    })
                    print(f"step {step + 1}: alpha {record['alpha']:.4f} predicted x alpha^2 "
                          f"{record['kl_predicted_scaled']:.3e} realised {record['kl_realized']:.3e}"
                          f" accuracy {record['accuracy']:.3f}", file=sys.stderr, flush=True)
            finally:
                job.close()
        finally:
            destroy_parallel()
    return steps


def _mean(pairs: list[tuple[float, float]]) -> float:
    return sum(t for t, _ in pairs) / sum(c for _, c in pairs)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarise(steps: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        ratios, selves = [], []
        for step in steps:
            predicted, realised, alpha = step["predicted"], step["realised"], step["alpha"]
            batch = _mean(realised)
            for start in range(0, len(predicted) - n + 1, n):
                m = _mean(predicted[start:start + n]) * alpha**2
                ratios.append(batch / m)
                selves.append(_mean(realised[start:start + n]) / m)
        logs = [math.log(r) for r in ratios]
        rows.append({
            "responses": n, "groups": len(ratios),
            "ratio_median": statistics.median(ratios),
            "log_ratio_std": statistics.pstdev(logs),
            "ratio_5_95": (_quantile(ratios, 0.05), _quantile(ratios, 0.95)),
            "within_20_percent": sum(0.8 <= r <= 1.25 for r in ratios) / len(ratios),
            "self_ratio_median": statistics.median(selves),
            "self_log_ratio_std": statistics.pstdev(math.log(r) for r in selves),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.steps < 1 or not sizes or min(sizes) < 1:
        print("error: --steps and every --sizes entry must be >= 1", file=sys.stderr)
        return 2
    init = args.init_checkpoint or warm_start(args)
    steps = run_steps(args, init)
    rows = summarise(steps, sizes)
    if args.json:
        print(json.dumps({"rows": rows, "steps": steps}, indent=1))
        return 0
    print("| probe responses | groups | median r | spread of r (std of log r) | r, 5-95% "
          "| within 0.8-1.25 | median r_self | std of log r_self |")
    print("|---:|---:|---:|---:|---|---:|---:|---:|")
    for row in rows:
        low, high = row["ratio_5_95"]
        print(f"| {row['responses']} | {row['groups']} | {row['ratio_median']:.3f} "
              f"| {row['log_ratio_std']:.3f} | {low:.2f}-{high:.2f} "
              f"| {100 * row['within_20_percent']:.0f}% | {row['self_ratio_median']:.3f} "
              f"| {row['self_log_ratio_std']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
