"""The one main() of the torchrun workers in this folder.

A worker is a script torchrun starts on every rank: it measures, writes JSON (or tensors), and
the pytest side (``tests/distributed/test_*.py``) asserts the claims on what it wrote. A worker
imports this module first, declares its measurements as named ``Case`` s and ends with
``run_worker(CASES, add_arguments)``. The harness:

* puts the repository first on ``sys.path`` (torchrun starts a worker as a script, so only this
  folder is on it), so the worker's ``megatron_logra`` and ``tests`` imports that follow resolve
  to this checkout;
* parses ``--case`` (required only where a worker has more than one case), ``--out`` (the
  directory everything is written to) and the worker's own arguments;
* refuses a case started with a process count it is not written for;
* sets up the process groups for the case's config with ``init_parallel`` and hands the case
  its config and groups;
* writes the report the case returns to ``--out/<case.output>`` from world rank 0 only, waits
  for every rank, and tears the groups down with ``destroy_parallel``, also when the case raised.

``raised_errors`` records the refusals a case provokes, for the tests that pin error messages.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch.distributed as dist  # noqa: E402

from megatron_logra.config import Config  # noqa: E402
from megatron_logra.mcore.process_groups import (  # noqa: E402
    ParallelGroups,
    destroy_parallel,
    init_parallel,
    world_size_from_env,
)

Report = dict[str, Any]


@dataclass(frozen=True)
class Case:
    """One named measurement of a worker."""

    config: Callable[[argparse.Namespace, int], Config]
    """The resolved config, from the arguments and the world size, whose layout is set up."""
    measure: Callable[[argparse.Namespace, Config, ParallelGroups], Report | None]
    """Runs on every rank; returns the JSON report (world rank 0's is written), or None when the
    case writes its own files under ``--out``."""
    output: str = "result.json"
    world_sizes: tuple[int, ...] | None = None
    """The process counts the case is written for; None: any."""


def run_worker(cases: Mapping[str, Case],
               add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    parser = argparse.ArgumentParser()
    only = next(iter(cases)) if len(cases) == 1 else None
    parser.add_argument("--case", choices=list(cases), default=only, required=only is None)
    parser.add_argument("--out", type=Path, required=True)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    case, world = cases[args.case], world_size_from_env()
    if case.world_sizes is not None and world not in case.world_sizes:
        counts = " or ".join(str(n) for n in case.world_sizes)
        raise ValueError(f"case {args.case!r} runs with {counts} processes, not {world}")
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        cfg = case.config(args, world)
        report = case.measure(args, cfg, init_parallel(cfg))
        if report is not None and dist.get_rank() == 0:
            (args.out / case.output).write_text(json.dumps(report, indent=2))
        dist.barrier()
    finally:
        destroy_parallel()


def switch_layout(cfg: Config) -> ParallelGroups:
    """Replace Megatron's groups of the current layout by ``cfg``'s; the process group stays."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return init_parallel(cfg)


def raised_errors(calls: Mapping[str, Callable[[], object]]) -> dict[str, str]:
    """What each call raises, as ``"Type: message"`` (``"no exception"`` when it returns)."""
    raised = {}
    for name, call in calls.items():
        try:
            call()
        except (ValueError, RuntimeError) as error:
            raised[name] = f"{type(error).__name__}: {error}"
            continue
        raised[name] = "no exception"
    return raised
