"""What the GPU check's sections share (tools/gpu_check.py, tools/gpu_check_sync.py): the two
outcomes besides success, the prerequisite probes, and the subprocess runner with its deadline."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


class SectionSkipped(Exception):
    """A prerequisite is missing; the message says which."""


class SectionFailed(Exception):
    """The section ran and a figure is out of tolerance (or a run failed); the message says which."""


# ----------------------------------------------------------------------------- prerequisites


def cuda_missing() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def gpus_missing(needed: int) -> str | None:
    missing = cuda_missing()
    if missing:
        return missing
    visible = torch.cuda.device_count()
    if visible < needed:
        return f"needs {needed} GPUs, {visible} visible"
    return None


def nccl_missing() -> str | None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return "this torch build has no NCCL"
    return None


def te_missing() -> str | None:
    # find_spec only: importing TE where it cannot work breaks `import megatron.core` (DESIGN §3).
    if importlib.util.find_spec("transformer_engine") is None:
        return "Transformer Engine is not installed (pip install transformer-engine[pytorch])"
    return None


def require(*reasons: str | None) -> None:
    for reason in reasons:
        if reason:
            raise SectionSkipped(reason)


# ----------------------------------------------------------------------------- subprocesses


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_logged(command: list[str], deadline: float, log: Path) -> str:
    """Run ``command`` until ``deadline`` (time.monotonic()); its output goes to ``log`` and is
    returned. A non-zero exit or the deadline is a SectionFailed naming the log."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise SectionFailed(f"out of time before {' '.join(command[:6])} ...")
    try:
        done = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                              timeout=remaining)
    except subprocess.TimeoutExpired as error:
        # TimeoutExpired carries bytes even under text=True.
        partial = [o.decode(errors="replace") if isinstance(o, bytes) else (o or "")
                   for o in (error.stdout, error.stderr)]
        log.write_text(f"{command}\ntimed out after {remaining:.0f} s\n" + "\n".join(partial))
        raise SectionFailed(f"timed out after {remaining:.0f} s ({log})") from error
    log.write_text(f"{command}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}")
    if done.returncode != 0:
        raise SectionFailed(f"exit {done.returncode} ({log}): {done.stderr.strip()[-300:]}")
    return done.stdout


def synthetic_data(out: Path, deadline: float) -> Path:
    data = out / "data"
    if not (data / "train.jsonl").exists():
        run_logged([sys.executable, "tools/make_synthetic_data.py", "--out", str(data), "--num-train",
              "3000", "--num-eval", "200", "--num-valid", "0", "--vocab-size", "96"],
             deadline, out / "data.log")
    return data


def within(figures: dict[str, Any], name: str, value: float, tolerance: float) -> bool:
    figures[name] = value
    figures[f"{name}_tolerance"] = tolerance
    return value <= tolerance
