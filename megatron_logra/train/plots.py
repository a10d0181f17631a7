"""PNG plots of a run's metrics.jsonl: the pictures a run leaves behind.

    python -m megatron_logra.train.plots runs/x/metrics.jsonl   (writes runs/x/plots/*.png)
"""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_logra.train.metrics import read_metrics

# (file name, title, y label, [(field, legend label)], log scale)
PANELS: tuple[tuple[str, str, str, tuple[tuple[str, str], ...], bool], ...] = (
    ("reward.png", "Training reward and accuracy", "fraction",
     (("reward", "mean reward"), ("accuracy", "accuracy")), False),
    ("eval.png", "Held-out evaluation", "fraction",
     (("eval_pass@1", "pass@1"), ("eval_pass@k", "pass@k"), ("eval_greedy", "greedy")), False),
    ("kl.png", "Per-token KL of each update", "nats",
     (("kl_predicted_scaled", "predicted (x alpha^2)"), ("kl_realized", "realised"),
      ("kl_budget_effective", "budget")), True),
    ("alpha.png", "KL controller step scale", "alpha", (("alpha", "alpha"),), False),
    ("loss.png", "Loss", "loss", (("loss", "loss"),), False),
    ("response_length.png", "Response length", "tokens",
     (("response_length", "mean response length"),), False),
)


def plot_metrics(metrics_path: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per panel that has data; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    out = Path(out_dir) if out_dir is not None else Path(metrics_path).parent / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, title, ylabel, fields, log_scale in PANELS:
        series = []
        for field, label in fields:
            points = [(r["step"], r[field]) for r in records
                      if isinstance(r.get(field), (int, float))]
            if points:
                series.append((label, points))
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
        for label, points in series:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3,
                    label=label)
        if log_scale:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / name)
        plt.close(fig)
        written.append(out / name)
    return written


if __name__ == "__main__":
    for path in plot_metrics(sys.argv[1]):
        print(path)  # noqa: T201
