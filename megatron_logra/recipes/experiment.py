"""Run a task as a NeMo-Run experiment and fail if the job failed; or render it without running.

NeMo-Run reports a failed job in its log ("finished: FAILED") but ``run.run`` returns as if all
were well, so a script or CI step built on it exits 0 after a failed training run. Here the
status is read back after the experiment ends and anything but SUCCEEDED raises.

NeMo-Run keeps experiments under ``base_dir`` (default: its home) and a job registry in its home,
``$NEMORUN_HOME`` (default ``~/.nemo_run``), read when nemo_run is first imported: set
NEMORUN_HOME in the environment to keep everything in a directory of your choice.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# How much of a failed job's log goes into the exception message: enough for the traceback or
# the configuration error that ended it.
_LOG_TAIL_CHARS = 4000


def _check_name(name: str) -> None:
    # The name becomes a directory name and part of the Slurm job name.
    if not _NAME.match(name):
        raise ValueError(
            f"name={name!r} is not a valid experiment name; use letters, digits, '_', '.', '-'"
        )


def _log_tail(job_dir: str) -> str:
    """The end of the job's combined log, when it is on this machine (local jobs)."""
    logs = sorted(Path(job_dir).rglob("combined.log")) if job_dir else []
    if not logs:
        return ""
    text = logs[-1].read_text(errors="replace")
    return f"\n--- end of {logs[-1]} ---\n{text[-_LOG_TAIL_CHARS:]}"


def run_and_check(
    task: Any, executor: Any, name: str, *, base_dir: str | Path | None = None,
    tail_logs: bool = False,
) -> None:
    """Run ``task`` on ``executor`` as experiment ``name``, wait for it, and raise RuntimeError
    naming the job (with its status, log directory and the end of its log) unless it SUCCEEDED.
    """
    _check_name(name)
    import nemo_run as run
    from torchx.specs import AppState

    with run.Experiment(
        name, executor=executor, log_level="WARN",
        base_dir=None if base_dir is None else str(base_dir), enable_goodbye_message=False,
    ) as exp:
        exp.add(task, name=name, tail_logs=tail_logs)
        exp.run(sequential=True, detach=False, tail_logs=tail_logs)
    # Only after the with-block: it waits for the jobs, and inside it they still read RUNNING.
    statuses = exp.status(return_dict=True) or {}
    if not statuses:
        raise RuntimeError(f"NeMo-Run experiment {name!r} reports no jobs; nothing ran")
    for job, info in statuses.items():
        if info["status"] != AppState.SUCCEEDED:
            raise RuntimeError(
                f"NeMo-Run job {job!r} of experiment {name!r} finished {info['status']}, not "
                f"SUCCEEDED; its files are in {info['local_dir']}{_log_tail(info['local_dir'])}"
            )


def render_sbatch(task: Any, executor: Any, name: str, *, base_dir: str | Path | None = None) -> str:
    """The sbatch script NeMo-Run would submit for ``task`` on a Slurm ``executor``, made by a
    dry run: nothing is submitted and nothing touches the cluster. The script is also left in
    the experiment directory under ``base_dir``."""
    _check_name(name)
    import nemo_run as run

    if not isinstance(executor, run.SlurmExecutor):
        raise ValueError(
            f"executor is a {type(executor).__name__}; render_sbatch needs a SlurmExecutor "
            "(see slurm_executor)"
        )
    with run.Experiment(
        name, executor=executor, log_level="WARN",
        base_dir=None if base_dir is None else str(base_dir), enable_goodbye_message=False,
    ) as exp:
        exp.add(task, name=name)
        exp.dryrun(log=False, delete_exp_dir=False)
        job_executor = exp.jobs[0].executor
    script = Path(job_executor.experiment_dir) / f"{job_executor.job_name}_sbatch.sh"
    if not script.is_file():
        raise RuntimeError(
            f"NeMo-Run's dry run of {name!r} wrote no sbatch script at {script}; the installed "
            "nemo_run may lay out experiments differently"
        )
    return script.read_text()
