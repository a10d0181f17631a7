"""Launch multi-process jobs over gloo from a test and fail with their output on error.

Multi-process tests run real Megatron-Core over gloo on CPU. Each test launches one job (a
worker script under ``tests/distributed/workers`` or the real CLI) and asserts on its exit
status and on the files it writes; a failing job's output is shown in the assertion message.

:func:`run_torchrun` starts the ranks itself, with the environment torchrun gives them (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), and stops the
others when one fails, as torchrun does: torchrun's own launcher process costs ~2.4 s of CPU
and ~3-5 s of wall time per job on these machines, over a hundred times per suite. Each rank
is a fork of a process that has already imported Megatron (tests/rank_zygote.py says what that
changes and what it keeps): the imports cost ~2.6-4 s of CPU per rank, several hundred times
per suite. With ``FRESH_RANKS_ENV`` set to 1 every rank is a fresh interpreter instead (to
compare, or to rule the forks out). The tests that exercise torchrun itself (signals,
preemption, the launch scripts) run the real one through :func:`torchrun_command`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_logra.local_ports import free_port
from tests.rank_zygote import run_ranks

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


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun --standalone --nproc_per_node=nproc sets for ``rank`` (one node)."""
    return {
        **torchrun_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }


# How often the launcher looks at its ranks: small against a job's seconds of Megatron import.
POLL_INTERVAL_S = 0.05
FRESH_RANKS_ENV = "MEGATRON_LOGRA_TESTS_FRESH_RANKS"


def run_torchrun(
    nproc: int, args: list[str], *, timeout_s: int = DEFAULT_TIMEOUT_S, cwd: Path | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` on ``nproc`` ranks as torchrun would (see the module docstring);
    raises AssertionError with every rank's output if the job times out or, with ``check``, if
    a rank fails (without: the result carries the first nonzero exit code, for a test that
    expects the job to refuse)."""
    command = [sys.executable, *args]
    port = free_port()
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        outs = [open(Path(logs) / f"{rank}.out", "w+") for rank in range(nproc)]  # noqa: SIM115
        errs = [open(Path(logs) / f"{rank}.err", "w+") for rank in range(nproc)]  # noqa: SIM115
        envs = [rank_env(rank, nproc, port) for rank in range(nproc)]
        if os.environ.get(FRESH_RANKS_ENV) == "1":
            codes, timed_out = _fresh_ranks(command, envs, cwd or REPO, outs, errs, deadline)
        else:
            codes, timed_out = run_ranks(
                list(args), envs, cwd or REPO, [Path(f.name) for f in outs],
                [Path(f.name) for f in errs], deadline_s=deadline, poll_s=POLL_INTERVAL_S)

        def read(files: list) -> str:
            text = []
            for handle in files:
                handle.seek(0)
                text.append(handle.read())
                handle.close()
            return "".join(text)

        stdout, stderr = read(outs), read(errs)
    returncode = next((code for code in codes if code != 0), 0)
    if timed_out or (check and returncode != 0):
        raise AssertionError(
            f"{'timed out after ' + str(timeout_s) + ' s' if timed_out else 'exited'} "
            f"{returncode} (rank exit codes {codes}): {nproc} x {' '.join(command)}\n"
            f"--- stdout ---\n{stdout[-6000:]}\n--- stderr ---\n{stderr[-6000:]}"
        )
    return subprocess.CompletedProcess(command, returncode, stdout, stderr)


def _fresh_ranks(command: list[str], envs: list[dict[str, str]], cwd: Path, outs: list,
                 errs: list, deadline: float) -> tuple[list[int], bool]:
    """Each rank a fresh ``python ARGS`` (FRESH_RANKS_ENV); the same stopping rule."""
    procs = [subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err, text=True)
             for env, out, err in zip(envs, outs, errs, strict=True)]
    timed_out = False
    while any(p.poll() is None for p in procs):
        failed = any(p.returncode not in (None, 0) for p in procs)
        timed_out = time.monotonic() > deadline
        if failed or timed_out:
            for p in procs:  # torchrun stops the job when one rank fails
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(POLL_INTERVAL_S)
    return [p.wait() for p in procs], timed_out
