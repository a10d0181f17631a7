"""Start a job's ranks as forks of processes that have already imported Megatron.

Every rank of every test job used to be a fresh interpreter that imported torch, Megatron-Core
and megatron_logra (~2.6-4 s of CPU each, several hundred ranks per suite) before doing a few
seconds of work. A *zygote* is a long-lived interpreter, started once per test session, that
imports those modules and then only forks: the child sets the rank's environment, working
directory, output files and ``sys.argv`` and runs the job's module (``-m megatron_logra ...``)
or script exactly as ``python ARGS`` would, ending with the interpreter's own exit handlers and
exit status. Nothing of a job is shared: each rank is its own process with its own memory,
process groups and files; only the import work is done once.

What a fresh interpreter would have different, and what is done about it:

* the string hash seed: one zygote per local rank (rank r of every job forks from zygote r),
  each started with its own random seed, so the ranks of a job disagree on set and dict order
  of strings as torchrun's fresh processes do (a code path that depends on that order across
  ranks still fails here);
* ``random`` and NumPy's global generators are reseeded from the OS in the child, as a fresh
  process would seed them; torch's default generator is untouched by the imports and starts
  from its fixed default seed, as in a fresh process;
* the import-time warnings of Megatron (apex, Transformer Engine absent) were printed once, by
  the zygote, not in each rank's stderr.

Runs that exercise process start-up itself (torchrun, signals, the launch scripts) do not come
here; they start real processes through :func:`tests.torchrun.torchrun_command`.

``python -m tests.rank_zygote`` is the zygote: one JSON request per line on stdin (argv, env,
cwd, stdout/stderr paths), answered on stdout by ``{"pid": N}`` once forked and
``{"pid": N, "returncode": C}`` when the child ends (C < 0: killed by signal -C); it exits when
stdin closes.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import random
import runpy
import select
import subprocess
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What the jobs import before their first line of work: the CLI's commands and the workers'
# Megatron layer.
PRELOAD = ("megatron_logra.mcore", "megatron_logra.cli", "megatron_logra.train.supervised",
           "megatron_logra.train.rl")


# ----------------------------------------------------------------------------- the zygote


def _exit_code(code: object) -> int:
    """The status ``sys.exit(code)`` gives a process (None: 0; not an int: printed, 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_child(job: dict, reply_fd: int) -> None:
    """In the fork: become ``python ARGV`` with the job's env, cwd and output; never returns."""
    code = 1
    try:
        os.close(reply_fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        argv = job["argv"]
        if argv[0] == "-m":
            # As ``python -m``: the working directory first on sys.path; run_module sets argv[0].
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = str(Path(argv[0]).resolve().parent)
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught error
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001, S110 - a closed stream has nothing to flush
                    pass
            os._exit(code)


def zygote_main() -> None:
    # Replies go to a private copy of stdout; fd 1 and 2 point to /dev/null so that nothing
    # printed by the imports can corrupt them (a child reopens both on its own files).
    reply_fd = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    replies = os.fdopen(reply_fd, "w", buffering=1)
    for name in PRELOAD:
        importlib.import_module(name)
    for line in sys.stdin:
        job = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(job, reply_fd)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})
                      + "\n")
    # Nothing to flush or clean up: skip the seconds of tearing down torch and Megatron.
    os._exit(0)


# ----------------------------------------------------------------------------- the client


class Zygote:
    """One zygote process and the line protocol with it (used by :func:`run_ranks`)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.rank_zygote"], cwd=REPO, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=False, bufsize=0,
        )
        self._buffer = b""

    def alive(self) -> bool:
        return self.process.poll() is None

    def fileno(self) -> int:
        return self.process.stdout.fileno()

    def fork(self, job: dict) -> int:
        self.process.stdin.write((json.dumps(job) + "\n").encode())
        return self.read_reply()["pid"]

    def ready(self) -> bool:
        return b"\n" in self._buffer

    def read_reply(self) -> dict:
        while b"\n" not in self._buffer:
            chunk = os.read(self.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"the rank zygote exited ({self.process.wait()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        """Ask the zygote to exit (it does when its stdin closes); :meth:`wait` reaps it."""
        if self.alive():
            self.process.stdin.close()

    def wait(self) -> None:
        self.process.wait()


_zygotes: dict[int, Zygote] = {}


def _zygote(local_rank: int, env: dict[str, str]) -> Zygote:
    zygote = _zygotes.get(local_rank)
    if zygote is None or not zygote.alive():
        # Without PYTHONHASHSEED in env each zygote draws its own hash seed.
        zygote = _zygotes[local_rank] = Zygote(env)
    return zygote


@atexit.register
def _close_zygotes() -> None:
    for zygote in _zygotes.values():
        zygote.close()
    for zygote in _zygotes.values():
        zygote.wait()


def run_ranks(argv: list[str], envs: list[dict[str, str]], cwd: Path, outs: list[Path],
              errs: list[Path], *, deadline_s: float, poll_s: float) -> tuple[list[int], bool]:
    """Run ``python ARGV`` once per env (rank r from zygote r); stop every rank when one fails
    or at ``deadline_s`` (a ``time.monotonic()``), as torchrun stops a job. Returns the ranks'
    exit codes and whether the deadline stopped them."""
    import signal
    import time

    base_env = {k: v for k, v in envs[0].items()
                if k not in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE",
                             "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    zygotes = [_zygote(rank, base_env) for rank in range(len(envs))]
    pids = [
        zygote.fork({"argv": argv, "env": env, "cwd": str(cwd), "stdout": str(out),
                     "stderr": str(err)})
        for zygote, env, out, err in zip(zygotes, envs, outs, errs, strict=True)
    ]
    codes: list[int | None] = [None] * len(pids)
    stopped = timed_out = False
    while any(code is None for code in codes):
        waiting = [z for z, code in zip(zygotes, codes, strict=True) if code is None]
        readable = [z for z in waiting if z.ready()] or select.select(waiting, [], [], poll_s)[0]
        for zygote in readable:
            reply = zygote.read_reply()
            codes[zygotes.index(zygote)] = reply["returncode"]
        failed = any(code not in (None, 0) for code in codes)
        timed_out = timed_out or time.monotonic() > deadline_s
        if (failed or timed_out) and not stopped:
            stopped = True
            for pid, code in zip(pids, codes, strict=True):
                if code is None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    return [int(code) for code in codes], timed_out


if __name__ == "__main__":
    zygote_main()
