"""NeMo-Run executors for megatron_logra: this machine (torchrun, GPU or CPU/gloo) and Slurm.

Both start one torchrun per node with one process per GPU (or ``nproc`` CPU processes); the
task (``recipes.py``) is what torchrun runs. nemo_run is imported inside the functions: it is an
optional dependency of the launcher, never of the training package.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

# Slurm's --time forms: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_SLURM_TIME = re.compile(r"^(\d+-\d{1,2}(:\d{2}){0,2}|\d+(:\d{2}){0,2})$")
# NeMo-Run writes environment variables into the sbatch script as `export KEY=VALUE`, unquoted:
# these characters would end the value or start another command. ($ stays allowed, so a value
# can refer to the job's own variables such as $SLURM_JOB_ID.)
_UNSAFE_IN_EXPORT = re.compile(r"[\s'\"`;&|<>()\\]")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def local_executor(
    nproc: int, cpu: bool, *, env_vars: Mapping[str, str] | None = None
) -> Any:
    """torchrun with ``nproc`` processes on this machine.

    ``cpu=True`` hides every GPU (``CUDA_VISIBLE_DEVICES=``), so ``parallel.device=auto``
    resolves to CPU/gloo, and gives each process an equal share of the cores.
    """
    _check_positive_int("nproc", nproc)
    env: dict[str, str] = {
        # NeMo-Run starts the `torchrun` found on PATH. Put the running interpreter's scripts
        # first, so that it is the torchrun of this environment (the one that has torch and
        # megatron_logra) even when the environment is not activated.
        "PATH": os.path.dirname(sys.executable),
    }
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
        # Without a limit every process starts one thread per core and they fight for the CPUs.
        env["OMP_NUM_THREADS"] = os.environ.get(
            "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc))
        )
    env.update(env_vars or {})
    import nemo_run as run

    return run.LocalExecutor(ntasks_per_node=nproc, launcher="torchrun", env_vars=env)


def slurm_executor(
    account: str,
    partition: str,
    nodes: int,
    gpus_per_node: int,
    time: str,
    *,
    job_dir: str,
    container_image: str | None = None,
    container_mounts: Sequence[str] = (),
    env_vars: Mapping[str, str] | None = None,
    ssh_host: str | None = None,
    ssh_user: str | None = None,
    packager: Any = None,
) -> Any:
    """An sbatch job of ``nodes`` nodes, each running one torchrun with ``gpus_per_node``
    processes (Pyxis/enroot container when ``container_image`` is given).

    ``job_dir`` is a directory on the cluster's shared filesystem where NeMo-Run keeps the job's
    scripts and logs. Jobs are submitted from this machine (a login node) unless ``ssh_host``
    is given. The default packager ships no code: ``python -m megatron_logra`` must then be
    importable in the container (or the cluster's environment) and config paths must be valid
    there; pass ``run.GitArchivePackager()`` to ship the committed repository instead (the job
    then runs from its root, so relative config paths work).
    """
    for name, value in (("account", account), ("partition", partition)):
        if not value:
            raise ValueError(f"{name} is empty; give the Slurm {name} to submit to")
    _check_positive_int("nodes", nodes)
    _check_positive_int("gpus_per_node", gpus_per_node)
    if not _SLURM_TIME.match(time):
        raise ValueError(
            f"time={time!r} is not a Slurm time limit; write HH:MM:SS or D-HH:MM:SS"
        )
    if not job_dir or not os.path.isabs(job_dir):
        raise ValueError(
            f"job_dir={job_dir!r} must be an absolute path on the cluster's shared filesystem"
        )
    if ssh_user is not None and ssh_host is None:
        raise ValueError("ssh_user is set but ssh_host is not; give both to submit over SSH")
    if isinstance(container_mounts, str):
        raise ValueError(
            f"container_mounts={container_mounts!r} is a string; pass a list of SRC:DST mounts"
        )
    for key, value in (env_vars or {}).items():
        if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", key):
            raise ValueError(
                f"env_vars key {key!r} must be an upper-case variable name (A-Z, 0-9, _): the "
                "sbatch script upper-cases names, so any other spelling would change"
            )
        if _UNSAFE_IN_EXPORT.search(value):
            raise ValueError(
                f"env_vars[{key!r}]={value!r} contains whitespace, quotes or shell operators, "
                "which the generated sbatch script does not quote; set it in the container "
                "image or a setup script instead"
            )
    # Imported after the checks, so that bad arguments fail the same way without nemo_run.
    import nemo_run as run

    if ssh_host is None:
        tunnel = run.LocalTunnel(job_dir=job_dir)
    else:
        tunnel = run.SSHTunnel(host=ssh_host, user=ssh_user or os.environ.get("USER", ""),
                               job_dir=job_dir)
    return run.SlurmExecutor(
        account=account,
        partition=partition,
        nodes=nodes,
        # One torchrun per node, which starts the per-GPU processes itself.
        ntasks_per_node=1,
        torchrun_nproc_per_node=gpus_per_node,
        gpus_per_node=gpus_per_node,
        time=time,
        container_image=container_image,
        container_mounts=list(container_mounts),
        env_vars=dict(env_vars or {}),
        tunnel=tunnel,
        packager=packager if packager is not None else run.Packager(),
        launcher="torchrun",
    )
