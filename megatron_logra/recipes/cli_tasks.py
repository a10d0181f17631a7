"""NeMo-Run recipes: configured tasks that run ``python -m megatron_logra SUBCOMMAND CONFIG ...``.

A recipe only describes the work; an executor (``executors.py``) says where it runs, and
``run_and_check`` (``experiment.py``) runs it and fails loudly if it fails::

    task = logra_rl_recipe("configs/rl_7b.yaml", ["train.steps=300"])
    run_and_check(task, local_executor(nproc=8, cpu=False), name="rl-7b")

Each task is a ``run.Script`` of the CLI, not a ``run.Partial`` of a Python function: NeMo-Run
runs a Partial and ignores what it returns, so a configuration error (the CLI returns 2) would
read as success, while a script's exit status is the job's status. Override order is the
recipe's knobs first, then the caller's, so the caller's values win (later overrides replace
earlier ones in the CLI).

nemo_run is imported inside the functions: it is an optional dependency of the launcher, never of
the training package.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_logra.config import COMMANDS, parse_override

SUBCOMMANDS: tuple[str, ...] = COMMANDS


def _format_value(value: Any) -> str:
    # YAML spelling, as the CLI parses overrides with YAML: true/false, not Python's True/False.
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def cli_task(subcommand: str, config: str | Path, overrides: Sequence[str] = ()) -> Any:
    """``python -m megatron_logra SUBCOMMAND CONFIG OVERRIDES...`` as a ``run.Script``.

    The config path is passed as given: it is read where the job runs (relative to the job's
    working directory), which need not be this machine.
    """
    if subcommand not in SUBCOMMANDS:
        raise ValueError(
            f"subcommand={subcommand!r} is not valid; choose one of {list(SUBCOMMANDS)}"
        )
    if not str(config):
        raise ValueError("config is empty; give the path of a YAML config file")
    if isinstance(overrides, str):
        raise ValueError(
            f"overrides={overrides!r} is a string; pass a list such as [{overrides!r}]"
        )
    # The CLI's own parser (torch-free, so a Slurm login node can run it): a misspelt key fails
    # at submission, not after the allocation starts.
    for text in overrides:
        parse_override(text)
    import nemo_run as run

    return run.Script(
        path="megatron_logra", entrypoint="python", m=True,
        args=[subcommand, str(config), *overrides],
    )


def train_recipe(config: str | Path, overrides: Sequence[str] = ()) -> Any:
    """Supervised training (dense or LoGRA, as the config says)."""
    return cli_task("train", config, overrides)


def sft_recipe(config: str | Path, overrides: Sequence[str] = ()) -> Any:
    """SFT warm start: the supervised stage before RL."""
    return cli_task("sft", config, overrides)


def logra_rl_recipe(
    config: str | Path,
    overrides: Sequence[str] = (),
    *,
    sketch_rank: int = 256,
    update_ratio: float = 6e-5,
    kl_budget: float = 2e-4,
    kl_budget_final: float = 2e-5,
    schedule_steps: int = 300,
    alpha_max: float = 3.0,
) -> Any:
    """RL with LoGRA in the paper's mode: rank-r sketches, update norm ``update_ratio`` of the
    target weights, and predicted-KL step control with a cosine budget from ``kl_budget`` to
    ``kl_budget_final`` over ``schedule_steps`` updates (defaults: the paper's)."""
    knobs = {
        "optimizer.name": "logra",
        "logra.mode": "paper",
        "logra.kl_control.enabled": True,
        "logra.sketch_rank": sketch_rank,
        "logra.update_ratio": update_ratio,
        "logra.kl_control.kl_budget": kl_budget,
        "logra.kl_control.kl_budget_final": kl_budget_final,
        "logra.kl_control.schedule_steps": schedule_steps,
        "logra.kl_control.alpha_max": alpha_max,
    }
    recipe = [f"{key}={_format_value(value)}" for key, value in knobs.items()]
    return cli_task("rl", config, [*recipe, *overrides])


def dense_rl_recipe(
    config: str | Path, overrides: Sequence[str] = (), *, distributed_optimizer: bool = True
) -> Any:
    """RL with dense Megatron Adam: the baseline LoGRA's memory and quality are measured
    against (with the distributed optimizer by default, the usual large-model setting)."""
    recipe = [
        "optimizer.name=adam",
        f"optimizer.use_distributed_optimizer={_format_value(distributed_optimizer)}",
    ]
    return cli_task("rl", config, [*recipe, *overrides])
