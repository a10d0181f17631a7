"""Launch torchrun subprocesses over gloo from a test and fail with their output on error.

Multi-process tests run real Megatron-Core over gloo on CPU. Each test launches one torchrun job
(a worker script under ``tests/distributed/workers`` or the real CLI) and asserts on its exit
status and on the files it writes; a failing job's output is shown in the assertion message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "distributed" / "workers"
# Generous: a 4-process job on a loaded 2-core machine imports Megatron four times (~4 s each).
DEFAULT_TIMEOUT_S = 600


def torchrun_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    """The argv of ``torchrun --standalone --nproc_per_node=nproc ARGS`` with this interpreter.

    ``args`` is what follows torchrun's own options: ``["-m", "megatron_logra", "train", ...]``
    or ``[str(WORKERS / "some_worker.py"), ...]``.
    """
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", *args,
    ]


def run_torchrun(
    nproc: int, args: list[str], *, timeout_s: int = DEFAULT_TIMEOUT_S, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``torchrun_command(nproc, args)``; raises AssertionError with the output on failure."""
    command = torchrun_command(nproc, args)
    result = subprocess.run(
        command, cwd=cwd or REPO, env=torchrun_env(), capture_output=True, text=True,
        timeout=timeout_s,
    )
    if result.returncode != 0:
        raise AssertionError(
            f"torchrun exited {result.returncode}: {' '.join(command)}\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
        )
    return result
