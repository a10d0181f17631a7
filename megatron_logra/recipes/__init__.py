"""Launching megatron_logra with NeMo-Run: recipes (what runs), executors (where), and
run_and_check / render_sbatch (run it and fail loudly, or show the sbatch script).

    from megatron_logra.recipes import local_executor, run_and_check, train_recipe

    task = train_recipe("configs/demo_cpu.yaml", ["optimizer.name=logra"])
    run_and_check(task, local_executor(nproc=2, cpu=True), name="demo")

Nothing here imports Megatron, and nemo_run only when a function is called, so this package is
importable where nemo_run is not installed. The plain torchrun scripts live in ``launch/`` at the
top of the repository.
"""

from megatron_logra.recipes.cli_tasks import (
    SUBCOMMANDS,
    cli_task,
    dense_rl_recipe,
    logra_rl_recipe,
    sft_recipe,
    train_recipe,
)
from megatron_logra.recipes.executors import local_executor, slurm_executor
from megatron_logra.recipes.experiment import render_sbatch, run_and_check

__all__ = [
    "SUBCOMMANDS",
    "cli_task",
    "dense_rl_recipe",
    "local_executor",
    "logra_rl_recipe",
    "render_sbatch",
    "run_and_check",
    "sft_recipe",
    "slurm_executor",
    "train_recipe",
]
