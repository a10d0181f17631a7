"""One metrics record per step: a readable console line on rank 0 and the same fields in JSONL.

    step  3/20 | loss 4.1234 | grad_norm 1.230e+00 | lr 1.00e-03 | tok/s 12,345 | 0.123 s
    | mem 512 MiB   (one line)

Every record is appended to ``<run.dir>/metrics.jsonl`` and flushed, so a crash loses at most the
step in flight and another process can follow the file while the run goes on.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from megatron_logra.train.metric_sinks import MetricSink

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_bytes(device: object) -> int:
    """Peak device memory of this process on a GPU, its peak resident set size on CPU."""
    import torch

    if getattr(device, "type", None) == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        resident_pages = int(handle.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


# How the console line shows a field (the JSONL record keeps the raw value).
_FIELD_FORMATS: dict[str, Callable[[Any], str]] = {
    "loss": lambda value: f"loss {value:.4f}",
    "grad_norm": lambda value: f"grad_norm {value:.3e}",
    "lr": lambda value: f"lr {value:.2e}",
    "tokens_per_s": lambda value: f"tok/s {value:,.0f}",
    "step_time_s": lambda value: f"{value:.3f} s",
    "master_merge_time_s": lambda value: f"merge {value:.3f} s",
    "mem_bytes": lambda value: f"mem {value / _MIB:,.0f} MiB",
    "kl_predicted_scaled": lambda value: f"kl_pred {value:.2e}",
    "kl_realized": lambda value: f"kl_real {value:.2e}",
    "alpha": lambda value: f"alpha {value:.3f}",
    "rollout_time_s": lambda value: f"rollout {value:.3f} s",
    "update_time_s": lambda value: f"update {value:.3f} s",
    "kl_probe_time_s": lambda value: f"probe {value:.3f} s",
    "sync_mode": lambda value: f"sync {value}",
    "microbatches": lambda value: f"mb {value}",
    "padding_fraction": lambda value: f"pad {100 * value:.1f}%",
    "sync_bytes": lambda value: f"sync {value:,} B",
    "sync_time_s": lambda value: f"sync {value:.3f} s",
    "sync_weights_match": lambda value: "weights equal" if value else "WEIGHTS DIFFER",
    "response_length": lambda value: f"resp_len {value:.1f}",
    "truncated_fraction": lambda value: f"truncated {value:.2f}",
    "eval_greedy": lambda value: f"eval_greedy {value:.3f}",
    "eval_pass@1": lambda value: f"eval_pass@1 {value:.3f}",
    "eval_truncated": lambda value: f"eval_truncated {value:.2f}",
}


def _format_field(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if key in _FIELD_FORMATS:
        return _FIELD_FORMATS[key](value)
    if isinstance(value, float):
        return f"{key} {value:.4g}"
    return f"{key} {value}"


# Fields shown on the console line, in this order; everything else goes only to JSONL.
CONSOLE_FIELDS: tuple[str, ...] = (
    "loss", "reward", "accuracy", "response_length", "truncated_fraction", "eval_greedy",
    "eval_pass@1", "eval_truncated", "grad_norm", "lr", "kl_predicted_scaled", "kl_realized",
    "alpha", "tokens_per_s", "step_time_s", "rollout_time_s", "update_time_s",
    "kl_probe_time_s", "microbatches", "padding_fraction", "master_merge_time_s", "sync_mode",
    "sync_bytes", "sync_time_s", "sync_weights_match", "mem_bytes",
)


class MetricsLog:
    """Writes step records. Only the process that owns it (rank 0) should create one."""

    def __init__(
        self,
        path: str | Path | None,
        *,
        total_steps: int,
        console: TextIO | None = sys.stdout,
        sinks: Sequence[MetricSink] = (),
    ) -> None:
        self.total_steps = total_steps
        self.console = console
        self.sinks = list(sinks)
        self._file: TextIO | None = None
        if path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a")

    def log(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if isinstance(value, float) and not math.isfinite(value):
                logger.warning("step %s: %s is %s", record.get("step"), key, value)
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=True) + "\n")
            self._file.flush()
        for sink in self.sinks:
            sink.log(record)
        if self.console is not None:
            width = len(str(self.total_steps))
            parts = [f"step {record.get('step', '?'):>{width}}/{self.total_steps}"]
            for key in CONSOLE_FIELDS:
                text = _format_field(key, record.get(key))
                if text is not None:
                    parts.append(text)
            print(" | ".join(parts), file=self.console, flush=True)  # noqa: T201

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]
