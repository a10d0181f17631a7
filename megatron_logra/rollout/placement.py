"""Where a separate engine's processes run: ``rollout.devices`` as the engine's environment, and
``rollout.cpus`` as the cores a CPU engine is pinned to.

The paper's deployment splits one node, e.g. 4 GPUs for the trainer and 4 for rollouts. The
engine's processes see only their own devices (``CUDA_VISIBLE_DEVICES``), so engine rank ``r``
-- which takes local device ``r`` (the Megatron engine's ``LOCAL_RANK``, vLLM's worker ``r``) --
runs on ``rollout.devices[r]``. Refused before anything starts: no CUDA on this machine, an index
the machine does not have, a device the trainer uses.

The trainer's devices are those its local ranks take: local rank ``i`` uses visible device
``i``, i.e. ``CUDA_VISIBLE_DEVICES[i]`` of the trainer's environment when that is set, else
device ``i``; the node runs ``LOCAL_WORLD_SIZE`` trainer ranks (torchrun's; 1 without it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence


def trainer_devices(environ: Mapping[str, str]) -> list[int]:
    """The machine's indices of the CUDA devices this node's trainer ranks use."""
    local_world = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(local_world))
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if not all(entry.isdigit() for entry in entries):
        raise ValueError(
            f"rollout.devices needs the trainer's CUDA_VISIBLE_DEVICES={visible!r} as device "
            "indices (not UUIDs) to tell which devices the trainer uses; set it as indices")
    return [int(entry) for entry in entries[:local_world]]


def engine_device_env(devices: Sequence[int], *, cuda_device_count: int,
                      environ: Mapping[str, str]) -> dict[str, str]:
    """The environment that places the engine's processes on ``devices`` (``rollout.devices``);
    empty when ``devices`` is. ``cuda_device_count``: what this process sees
    (``torch.cuda.device_count()``); ``environ``: the trainer's environment."""
    if not devices:
        return {}
    if cuda_device_count == 0:
        raise ValueError(f"rollout.devices={list(devices)} needs CUDA devices, and this machine "
                         "has none; drop rollout.devices (the engine then follows "
                         "parallel.device)")
    if "CUDA_VISIBLE_DEVICES" not in environ and max(devices) >= cuda_device_count:
        raise ValueError(f"rollout.devices={list(devices)} names device {max(devices)}, and this "
                         f"machine has {cuda_device_count} (0-{cuda_device_count - 1}); choose "
                         "devices it has")
    trainer = trainer_devices(environ)
    overlap = sorted(set(devices) & set(trainer))
    if overlap:
        raise ValueError(
            f"rollout.devices={list(devices)} overlaps the trainer's devices "
            f"{trainer} at {overlap}: the engine and the trainer would share "
            "a GPU; give the engine devices of its own")
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices)}


def pin_to_cpus(pid: int, cpus: Sequence[int], what: str) -> None:
    """Pin process ``pid`` (right after its start: threads it makes later inherit this) to the
    CPU cores ``cpus`` (``rollout.cpus``); a core the machine does not let it use is a
    ValueError naming the setting."""
    if not cpus:
        return
    try:
        os.sched_setaffinity(pid, set(cpus))
    except OSError as error:
        raise ValueError(f"rollout.cpus={list(cpus)}: cannot pin {what} to those cores "
                         f"({error}); this machine offers cores "
                         f"{sorted(os.sched_getaffinity(0))} to this process") from error
