"""The files a run leaves in ``run.dir``, and the bookkeeping of them across resumes."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from megatron_logra.atomic_write import write_atomically
from megatron_logra.config import Config
from megatron_logra.train.metrics import read_metrics

METRICS_FILE = "metrics.jsonl"
STATE_BYTES_FILE = "state_bytes.json"
FULL_WEIGHTS_FILE = "full_weights.pt"
RESOLVED_CONFIG_FILE = "config.yaml"
MODEL_DIR = "model"


def prepare_run_dir(cfg: Config, start_step: int) -> None:
    """Create ``run.dir``, keep its metrics up to ``start_step`` and write the resolved config
    (rank 0 only)."""
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    keep_metrics_up_to(run_dir / METRICS_FILE, start_step)
    (run_dir / RESOLVED_CONFIG_FILE).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def keep_metrics_up_to(path: Path, step: int) -> None:
    """A fresh run starts a new metrics file; a resumed one keeps the records up to its
    checkpoint and drops any written after it by the interrupted run."""
    if step == 0 or not path.is_file():
        path.unlink(missing_ok=True)
        return
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    write_atomically(path, "".join(json.dumps(r, allow_nan=True) + "\n" for r in kept))
