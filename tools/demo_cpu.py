"""The CPU demo: the same small GPT trained with dense Adam and with LoGRA, side by side.

    make demo            (or: python tools/demo_cpu.py [--steps N])

Two processes with tensor parallelism 2 over gloo, on a synthetic arithmetic corpus the project
generates and tokenizes with a SentencePiece model it trains. Prints both loss curves and the
persistent training state of each method (weights, gradients, optimizer state, sketches), and
writes a plot to runs/demo/loss_curves.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_logra.data.dataset_dir import SyntheticDataSpec, write_synthetic_dataset  # noqa: E402
from megatron_logra.metrics import read_metrics  # noqa: E402

CONFIG = REPO / "configs" / "demo_cpu.yaml"
DATA_DIR = REPO / ".data" / "synthetic"
OUT_DIR = REPO / "runs" / "demo"
METHODS = ("adam", "logra")
CATEGORIES = ("weights", "grads", "optimizer_state", "sketches", "projections")


def run_method(method: str, steps: int | None) -> Path:
    run_dir = OUT_DIR / method
    overrides = [f"optimizer.name={method}", f"run.dir={run_dir}", f"data.dir={DATA_DIR}"]
    if steps is not None:
        overrides.append(f"train.steps={steps}")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "-m", "megatron_logra", "train", str(CONFIG), *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    print(f"\n=== {method}: {' '.join(command[3:])}", flush=True)
    subprocess.run(command, cwd=REPO, env=env, check=True)
    return run_dir


def print_curves(records: dict[str, list[dict]]) -> None:
    steps = [r["step"] for r in records[METHODS[0]]]
    stride = max(1, len(steps) // 12)
    print("\nloss by step (token-mean cross-entropy on the training batch)")
    print(f"{'step':>6} " + " ".join(f"{m:>10}" for m in METHODS))
    for index in list(range(0, len(steps), stride)) + ([len(steps) - 1] if len(steps) % stride != 1 else []):
        row = " ".join(f"{records[m][index]['loss']:>10.4f}" for m in METHODS)
        print(f"{steps[index]:>6} {row}")


def plot_curves(records: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for method in METHODS:
        ax.plot([r["step"] for r in records[method]], [r["loss"] for r in records[method]],
                label={"adam": "dense Adam", "logra": "LoGRA"}[method])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Same GPT, TP=2 on CPU: dense Adam vs LoGRA")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def print_state_table(state: dict[str, dict]) -> None:
    print("\npersistent training state, summed over both ranks (bytes)")
    print(f"{'':>16} " + " ".join(f"{m:>14}" for m in METHODS) + f" {'logra/adam':>11}")
    totals = {m: sum(state[m]["total"].values()) for m in METHODS}
    for category in (*CATEGORIES, "total"):
        values = {m: state[m]["total"].get(category, 0) if category != "total" else totals[m]
                  for m in METHODS}
        ratio = f"{values['logra'] / values['adam']:.3f}" if values["adam"] else "-"
        print(f"{category:>16} " + " ".join(f"{values[m]:>14,}" for m in METHODS) + f" {ratio:>11}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="override train.steps")
    args = parser.parse_args()
    start = time.perf_counter()
    if not (DATA_DIR / "tokens.npy").is_file():
        print(f"creating the synthetic dataset in {DATA_DIR}", flush=True)
        write_synthetic_dataset(DATA_DIR, SyntheticDataSpec())
    records, state = {}, {}
    for method in METHODS:
        run_dir = run_method(method, args.steps)
        records[method] = read_metrics(run_dir / "metrics.jsonl")
        state[method] = json.loads((run_dir / "state_bytes.json").read_text())
    print_curves(records)
    print_state_table(state)
    plot_path = OUT_DIR / "loss_curves.png"
    plot_curves(records, plot_path)
    final = {m: records[m][-1]["loss"] for m in METHODS}
    print(f"\nfinal loss: dense Adam {final['adam']:.4f}, LoGRA {final['logra']:.4f}")
    print(f"plot: {plot_path.relative_to(REPO)}; metrics: runs/demo/<method>/metrics.jsonl")
    print(f"demo wall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
