"""Launchers: the torchrun scripts in launch/ and the NeMo-Run recipes and executors.

Jobs run for real on CPU (2 processes over gloo, a 1-layer model, 2 steps). NeMo-Run runs in a
subprocess whose NEMORUN_HOME is the test's tmp dir: NeMo-Run reads it once, at import, and would
otherwise write to the user's home. The Slurm test renders the sbatch script by a dry run and
submits nothing.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_logra.recipes import (
    cli_task,
    dense_rl_recipe,
    local_executor,
    logra_rl_recipe,
    run_and_check,
    sft_recipe,
    slurm_executor,
    train_recipe,
)
from megatron_logra.train.metrics import read_metrics
from tests.presets import tiny_width
from tests.torchrun import DEFAULT_TIMEOUT_S, REPO, torchrun_env

CONFIG = str(REPO / "configs" / "demo_cpu.yaml")
SINGLE_NODE = str(REPO / "launch" / "torchrun_single_node.sh")
MULTI_NODE = str(REPO / "launch" / "torchrun_multi_node.sh")
STEPS = 2
TINY_MODEL = [*tiny_width(), "model.num_layers=1"]
# A dry run or a usage error does no work beyond bash and a `command -v`; generous for CI.
SCRIPT_ONLY_WALL_S = 30
# Variables the launch scripts read: cleared so that the test's own environment (a CI job that
# itself runs under Slurm, say) cannot change what the scripts compute.
LAUNCH_ENV_VARS = (
    "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC", "DEVICE",
    "SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_NODEID", "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
)


def _script_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in torchrun_env().items() if k not in LAUNCH_ENV_VARS}
    env["PYTHON"] = sys.executable
    env.update(extra)
    return env


def _train_overrides(data_dir: Path, run_dir: Path) -> list[str]:
    return [f"data.dir={data_dir}", f"run.dir={run_dir}", f"train.steps={STEPS}", *TINY_MODEL]


def _run_driver(code: str, nemorun_home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` (which reads its arguments from sys.argv) in a fresh interpreter."""
    env = torchrun_env()
    env["NEMORUN_HOME"] = str(nemorun_home)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=DEFAULT_TIMEOUT_S,
    )


# ------------------------------------------------------------------ torchrun_single_node.sh


@pytest.mark.distributed
def test_single_node_script_trains_on_two_cpu_processes_and_logs_every_step(
    synthetic_data_dir, tmp_path
):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        ["bash", SINGLE_NODE, "--cpu", "--nproc", "2", "train", CONFIG,
         *_train_overrides(synthetic_data_dir, run_dir)],
        cwd=REPO, env=_script_env(), capture_output=True, text=True, timeout=DEFAULT_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cpu", "eval", CONFIG], "subcommand 'eval' is not valid; use one of: train sft rl"),
        (["--cpu", "train", "missing.yaml"], "config file 'missing.yaml' does not exist"),
        (["--cpu", "train", CONFIG, "steps=3"], "override 'steps=3' must look like section.key=value"),
        (["--cpu", "train", CONFIG, "parallel.device=cuda"],
         "override 'parallel.device=cuda' contradicts --cpu/DEVICE=cpu"),
        (["--cpu", "--nproc", "0", "train", CONFIG], "process count '0' must be a positive integer"),
    ],
)
def test_single_node_script_refuses_bad_arguments_with_exit_code_2(args, message):
    result = subprocess.run(
        ["bash", SINGLE_NODE, "--dry-run", *args], cwd=REPO, env=_script_env(),
        capture_output=True, text=True, timeout=SCRIPT_ONLY_WALL_S,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr


RL_CONFIG = str(REPO / "configs" / "demo_rl_cpu.yaml")
# The preflight check loads and resolves the config in one Python process that imports no torch
# (measured 0.3 s); generous for a loaded CI machine.
PREFLIGHT_WALL_S = 60


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", CONFIG, "optimizer.name=nope"], "optimizer.name='nope' is not valid"),
        # Checked against the launch's world size (--nproc 2), not a single process's.
        (["train", CONFIG, "parallel.tp=4"],
         "world size 2 is not divisible by parallel.tp * parallel.cp * parallel.pp = 4"),
        (["rl", RL_CONFIG, "parallel.tp=1", "model.activation=swiglu",
          "model.normalization=RMSNorm", "rollout.placement=separate", "rollout.engine=vllm",
          "rollout.vllm_venv=no-such-venv"],
         "rollout.engine=vllm: the vLLM venv no-such-venv (rollout.vllm_venv='no-such-venv') "
         "does not exist: run `make setup-vllm`"),
        # Generation overlapping training needs an engine of its own.
        (["rl", RL_CONFIG, "rollout.max_staleness=1"],
         "rollout.max_staleness=1 with rollout.placement=colocated"),
    ],
    ids=["bad_value", "world_size", "no_vllm_venv", "colocated_staleness"],
)
def test_single_node_script_refuses_a_bad_configuration_with_exit_code_2_before_any_rank(
        args, message, tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        ["bash", SINGLE_NODE, "--cpu", "--nproc", "2", *args, f"run.dir={run_dir}"], cwd=REPO,
        env=_script_env(), capture_output=True, text=True, timeout=PREFLIGHT_WALL_S,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count(f"megatron-logra: configuration error: {message}") == 1, \
        result.stderr
    # torchrun never ran: the script prints its command line only when it runs it.
    assert "torch.distributed.run" not in result.stdout and not run_dir.exists()


# ------------------------------------------------------------------- torchrun_multi_node.sh


def _multi_node_dry_run(args: list[str], **env: str) -> list[str]:
    result = subprocess.run(
        ["bash", MULTI_NODE, "--dry-run", *args], cwd=REPO, env=_script_env(**env),
        capture_output=True, text=True, timeout=SCRIPT_ONLY_WALL_S,
    )
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout.strip())


def test_multi_node_script_takes_the_rendezvous_from_slurm_under_srun():
    command = _multi_node_dry_run(
        ["rl", CONFIG, "train.steps=5"],
        NPROC="8", SLURM_JOB_ID="77", SLURM_NNODES="4", SLURM_NTASKS="4", SLURM_NODEID="2",
        SLURM_JOB_NODELIST="gpu[007-010],cpu1",
    )
    assert command == [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=4", "--node_rank=2",
        "--nproc_per_node=8", "--master_addr=gpu007", "--master_port=29500",
        "-m", "megatron_logra", "rl", CONFIG, "train.steps=5",
    ]


def test_multi_node_script_prefers_explicit_master_variables_and_runs_cpu_over_gloo():
    command = _multi_node_dry_run(
        ["--cpu", "--nproc", "2", "train", CONFIG],
        MASTER_ADDR="10.0.0.5", MASTER_PORT="6000", NNODES="2", NODE_RANK="1",
        OMP_NUM_THREADS="3",
        # Under srun as well: the explicit variables must win over the Slurm ones.
        SLURM_JOB_ID="77", SLURM_NNODES="4", SLURM_NTASKS="4", SLURM_NODEID="3",
        SLURM_JOB_NODELIST="gpu[007-010]",
    )
    assert command == [
        "env", "CUDA_VISIBLE_DEVICES=", "OMP_NUM_THREADS=3",
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--node_rank=1",
        "--nproc_per_node=2", "--master_addr=10.0.0.5", "--master_port=6000",
        "-m", "megatron_logra", "train", CONFIG, "parallel.device=cpu",
    ]


def test_launch_scripts_pass_several_config_files_in_order_before_the_overrides():
    # A preset, then a converted model's model.yaml (any second file here): both reach the CLI
    # (and its preflight check) in order, the overrides after them.
    command = _multi_node_dry_run(["--cpu", "--nproc", "2", "rl", CONFIG, RL_CONFIG,
                                   "train.steps=5"], NNODES="1", NODE_RANK="0",
                                  MASTER_ADDR="127.0.0.1")
    assert command[command.index("megatron_logra"):] == [
        "megatron_logra", "rl", CONFIG, RL_CONFIG, "train.steps=5", "parallel.device=cpu"]
    result = subprocess.run(
        ["bash", SINGLE_NODE, "--dry-run", "--cpu", "rl", CONFIG, "no-such.yaml"], cwd=REPO,
        env=_script_env(), capture_output=True, text=True, timeout=SCRIPT_ONLY_WALL_S)
    assert result.returncode == 2 and "config file 'no-such.yaml' does not exist" in result.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "NNODES is not set and this is not a Slurm job step"),
        ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "n0"},
         "NODE_RANK=2 must be an integer in 0..1 (NNODES=2)"),
        ({"NNODES": "2", "NODE_RANK": "0"}, "MASTER_ADDR is not set"),
        ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "n0", "MASTER_PORT": "70000"},
         "MASTER_PORT=70000 must be a port number"),
        ({"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NTASKS": "16", "SLURM_NODEID": "0",
          "SLURM_JOB_NODELIST": "n[1-2]"},
         "Slurm started 16 tasks on 2 nodes; start one per node"),
    ],
)
def test_multi_node_script_refuses_an_incomplete_rendezvous_with_exit_code_2(env, message):
    result = subprocess.run(
        ["bash", MULTI_NODE, "--dry-run", "--cpu", "train", CONFIG], cwd=REPO,
        env=_script_env(**env), capture_output=True, text=True, timeout=SCRIPT_ONLY_WALL_S,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr


# --------------------------------------------------------------------------------- NeMo-Run

_RUN_TRAIN_RECIPE = """
    import json, sys
    from megatron_logra.recipes import local_executor, run_and_check, train_recipe

    nproc, name, base_dir, config, overrides = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
    run_and_check(train_recipe(config, overrides), local_executor(nproc, cpu=True), name, base_dir=base_dir)
"""


@pytest.mark.distributed
def test_run_and_check_runs_the_train_recipe_on_two_local_cpu_processes(
    synthetic_data_dir, tmp_path
):
    run_dir = tmp_path / "run"
    overrides = _train_overrides(synthetic_data_dir, run_dir)
    result = _run_driver(
        _RUN_TRAIN_RECIPE, tmp_path / "nemo_run_home",
        "2", "train-ok", str(tmp_path / "experiments"), CONFIG, json.dumps(overrides),
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))


@pytest.mark.distributed
def test_run_and_check_raises_naming_the_job_when_the_job_fails(synthetic_data_dir, tmp_path):
    # The CLI exits 2 on this override; NeMo-Run itself would return normally.
    overrides = [*_train_overrides(synthetic_data_dir, tmp_path / "run"), "optimizer.name=nope"]
    result = _run_driver(
        _RUN_TRAIN_RECIPE, tmp_path / "nemo_run_home",
        "1", "train-bad", str(tmp_path / "experiments"), CONFIG, json.dumps(overrides),
    )
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-4000:]
    assert "RuntimeError: NeMo-Run job 'train-bad' of experiment 'train-bad' finished FAILED" \
        in result.stderr, result.stderr[-4000:]
    # The exception carries the end of the job's log, where the CLI named the bad field.
    assert "optimizer.name='nope' is not valid" in result.stderr, result.stderr[-4000:]


_RENDER_SBATCH = """
    import sys
    from megatron_logra.recipes import logra_rl_recipe, render_sbatch, slurm_executor

    job_dir, base_dir, out = sys.argv[1], sys.argv[2], sys.argv[3]
    executor = slurm_executor(
        "acct", "batch", 3, 4, "02:00:00", job_dir=job_dir,
        container_image="registry.example/logra:1", container_mounts=["/data:/data"],
        env_vars={"NCCL_DEBUG": "WARN", "HF_HOME": "/data/hf"},
    )
    task = logra_rl_recipe("configs/rl.yaml", ["train.steps=3"], sketch_rank=128)
    open(out, "w").write(render_sbatch(task, executor, "rl-render", base_dir=base_dir))
"""


def test_slurm_sbatch_script_asks_for_the_nodes_and_gpus_and_runs_torchrun_of_the_cli(tmp_path):
    cluster_job_dir = tmp_path / "cluster_jobs"
    out = tmp_path / "sbatch.sh"
    result = _run_driver(
        _RENDER_SBATCH, tmp_path / "nemo_run_home",
        str(cluster_job_dir), str(tmp_path / "experiments"), str(out),
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    script = out.read_text()
    lines = script.splitlines()
    for directive in (
        "#SBATCH --account=acct", "#SBATCH --partition=batch", "#SBATCH --time=02:00:00",
        "#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
        "export NCCL_DEBUG=WARN", "export HF_HOME=/data/hf",
    ):
        assert directive in lines, f"{directive!r} missing from:\n{script}"
    (srun,) = [line for line in lines if line.startswith("srun ")]
    words = shlex.split(srun)
    assert words[words.index("--container-image") + 1] == "registry.example/logra:1"
    assert "/data:/data" in words[words.index("--container-mounts") + 1].split(",")
    torchrun = words[words.index("torchrun"):]
    assert torchrun[torchrun.index("--nnodes") + 1] == "3"
    assert torchrun[torchrun.index("--nproc-per-node") + 1] == "4"
    assert torchrun[torchrun.index("-m"):] == [
        "-m", "megatron_logra", "rl", "configs/rl.yaml", "optimizer.name=logra", "logra.mode=paper",
        "logra.kl_control.enabled=true", "logra.sketch_rank=128", "logra.update_ratio=6e-05",
        "logra.kl_control.kl_budget=0.0002",
        "logra.kl_control.kl_budget_final=2e-05", "logra.kl_control.schedule_steps=300",
        "logra.kl_control.alpha_max=3.0", "train.steps=3",
    ]
    # A dry run: nothing was copied to (or created in) the cluster's job directory.
    assert not cluster_job_dir.exists()


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [
        (lambda: train_recipe("c.yaml", ["train.steps=1"]), ["train", "c.yaml", "train.steps=1"]),
        (lambda: sft_recipe("c.yaml"), ["sft", "c.yaml"]),
        (lambda: dense_rl_recipe("c.yaml", ["optimizer.lr=1e-5"]),
         ["rl", "c.yaml", "optimizer.name=adam", "optimizer.use_distributed_optimizer=true",
          "optimizer.lr=1e-5"]),
        # The caller's overrides come last, so they win over the recipe's knobs.
        (lambda: logra_rl_recipe("c.yaml", ["logra.sketch_rank=64"], kl_budget=1e-3),
         ["rl", "c.yaml", "optimizer.name=logra", "logra.mode=paper", "logra.kl_control.enabled=true",
          "logra.sketch_rank=256",
          "logra.update_ratio=6e-05", "logra.kl_control.kl_budget=0.001",
          "logra.kl_control.kl_budget_final=2e-05", "logra.kl_control.schedule_steps=300",
          "logra.kl_control.alpha_max=3.0", "logra.sketch_rank=64"]),
    ],
)
def test_recipes_run_the_cli_with_their_knobs_before_the_callers_overrides(recipe, expected):
    assert recipe().to_command(with_entrypoint=True) == ["python", "-m", "megatron_logra", *expected]


ONE_STEP_OFF = ["rollout.placement=separate", "rollout.max_staleness=1"]


def test_the_launch_preflight_and_the_recipes_accept_one_step_off_rollouts(synthetic_data_dir,
                                                                          tmp_path):
    """What the launch scripts run before any rank (``megatron_logra check``) accepts a
    separate engine generating one step ahead, and the recipes pass the setting to the CLI."""
    result = subprocess.run(
        [sys.executable, "-m", "megatron_logra", "check", "--world-size=2", "rl", RL_CONFIG,
         *ONE_STEP_OFF, f"data.dir={synthetic_data_dir}", f"run.dir={tmp_path / 'run'}"],
        cwd=REPO, env=_script_env(), capture_output=True, text=True, timeout=PREFLIGHT_WALL_S)
    assert result.returncode == 0, result.stderr
    for recipe in (logra_rl_recipe, dense_rl_recipe):
        assert recipe(RL_CONFIG, ONE_STEP_OFF).to_command()[-2:] == ONE_STEP_OFF


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: slurm_executor("", "batch", 1, 8, "01:00:00", job_dir="/jobs"),
         "account is empty"),
        (lambda: slurm_executor("a", "batch", 0, 8, "01:00:00", job_dir="/jobs"),
         "nodes=0 must be a positive integer"),
        (lambda: slurm_executor("a", "batch", 1, 8, "1h", job_dir="/jobs"),
         "time='1h' is not a Slurm time limit; write HH:MM:SS"),
        (lambda: slurm_executor("a", "batch", 1, 8, "01:00:00", job_dir="jobs"),
         "job_dir='jobs' must be an absolute path"),
        (lambda: slurm_executor("a", "batch", 1, 8, "1-00:00:00", job_dir="/jobs",
                                env_vars={"NCCL_DEBUG": "INFO WARN"}),
         "env_vars['NCCL_DEBUG']='INFO WARN' contains whitespace"),
        (lambda: slurm_executor("a", "batch", 1, 8, "30", job_dir="/jobs",
                                env_vars={"nccl_debug": "INFO"}),
         "env_vars key 'nccl_debug' must be an upper-case variable name"),
        (lambda: local_executor(0, cpu=True), "nproc=0 must be a positive integer"),
        (lambda: cli_task("eval", "c.yaml"), "subcommand='eval' is not valid"),
        (lambda: train_recipe("c.yaml", "train.steps=1"), "is a string; pass a list"),
        (lambda: train_recipe("c.yaml", ["steps=1"]),
         "override 'steps=1' must look like section.key=value"),
        (lambda: run_and_check(None, None, "my run"), "name='my run' is not a valid experiment name"),
    ],
)
def test_launch_functions_refuse_bad_arguments_naming_the_field(call, message):
    with pytest.raises(ValueError) as error:
        call()
    assert message in str(error.value)
