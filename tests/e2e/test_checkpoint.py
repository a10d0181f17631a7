"""Checkpoints through the real CLI (DESIGN section 6, rung 4; issue [pipeline] items 3-5).

* resume == uninterrupted: a new job resumed from the step-3 checkpoint of a 6-step run
  finishes it with losses and final weights bit-identical on CPU in fp32 (DP=2, distributed
  optimizer);
* resharded resume: save at PP=2 x VPP=2, resume at TP=2 x PP=2; save at TP=2 x PP=2, resume
  at TP=1 x PP=1 (one chain of three jobs); and with bf16
  sharded masters from DP=2 to TP=2 x PP=2: the uninterrupted run's losses and weights, to the
  tolerance of the arithmetic that changed;
* a save killed half-way leaves the previous checkpoint as the newest loadable one;
* a corrupt or truncated file, and a run with incompatible LoGRA settings, are refused with an
  error naming the problem; checkpoint.verify=false skips only the manifest check;
* SIGTERM makes every rank finish its step, write a checkpoint and stop.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from megatron_logra.mcore.checkpointing.checkpoint import KILL_DURING_SAVE_ENV, MANIFEST
from megatron_logra.train.metrics import read_metrics
from tests.cli_runs import CliRuns
from tests.layouts import (
    BF16_RESHARD_LOSS_REL_TOL,
    BF16_RESHARD_WEIGHT_NORM_REL_TOL,
    DISTOPT,
    LAYOUTS,
    PP2,
    RESHARD_LOSS_REL_TOL,
    RESHARD_WEIGHT_REL_TOL,
    TP2,
    max_entry_rel_err,
    norm_rel_err,
)
from tests.presets import tiny_logra_run
from tests.torchrun import REPO, run_torchrun, torchrun_env

pytestmark = pytest.mark.distributed

CONFIG = REPO / "configs" / "demo_cpu.yaml"
STEPS = 6
BASE = [
    *tiny_logra_run(STEPS), "train.micro_batch_size=4", "optimizer.lr=0.01",
    "optimizer.lr_warmup_steps=0", "run.save_full_weights=true",
]
BF16 = ["model.params_dtype=bf16", "optimizer.lr=0.002"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic_data_dir) -> CliRuns:
    return CliRuns(tmp_path_factory.mktemp("checkpoints"), "train", CONFIG, BASE,
                   synthetic_data_dir)


# The full run saves after step 3 as well: the resume test forks from it, the corrupt-file
# tests damage a copy of it.
MID_STEP = 3


def _full(runs: CliRuns) -> Path:
    """Six steps at DP=2 with the distributed optimizer, checkpointed after steps 3 and 6."""
    nproc, layout = LAYOUTS["dp2_distopt"]
    return runs.run("full", nproc, [*layout, f"checkpoint.interval={MID_STEP}"], checkpointed=True)


def _reference_tp1(runs: CliRuns) -> Path:
    return runs.run("reference_tp1", *LAYOUTS["tp1"])


def _losses(run_dir: Path) -> list[float]:
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["loss"] for r in records]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "full_weights.pt")


def _assert_resumed_matches(resumed: Path, reference: Path, *, loss_rel_tol: float,
                            weight_err: Callable[[torch.Tensor, torch.Tensor], float],
                            weight_tol: float) -> None:
    """Every step's loss within ``loss_rel_tol``, every final tensor within ``weight_tol``."""
    for got, want in zip(_losses(resumed), _losses(reference), strict=True):
        assert abs(got - want) <= loss_rel_tol * abs(want)
    want_w, got_w = _weights(reference), _weights(resumed)
    for key, tensor in want_w.items():
        err = weight_err(got_w[key], tensor)
        assert err < weight_tol, (key, err)


def _digest(checkpoint: Path) -> str:
    """tools/checkpoint_digest.py's digest line, the tool run as a one-rank job."""
    result = run_torchrun(1, [str(REPO / "tools" / "checkpoint_digest.py"), str(checkpoint)],
                          timeout_s=120)
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("digest ")
    return last.split()[1]


def test_resume_is_bitwise_equal_to_the_uninterrupted_run(runs):
    """Steps 4-6 in a new job from the full run's step-3 checkpoint. The claim is the one a
    job stopped after step 3 (``train.exit_interval``) and resumed makes: what a checkpoint
    holds is the state after its step whichever way the job went on, and the resumed job
    starts from nothing but that checkpoint. (The stopping save is exercised by the chained
    reshards below.)"""
    full = _full(runs)
    split = runs.forked("split", "full", MID_STEP, LAYOUTS["dp2_distopt"])
    assert _losses(split) == _losses(full)
    want, got = _weights(full), _weights(split)
    assert all(torch.equal(got[k], want[k]) for k in want)
    final = f"iter_{STEPS:07d}"
    assert _digest(runs.checkpoint_dir("split") / final) == _digest(
        runs.checkpoint_dir("full") / final)


def test_resharded_resume_matches_the_uninterrupted_run(runs):
    """Steps 1-2 at PP=2 x VPP=2, 3-4 resumed at TP=2 x PP=2, 5-6 resumed at TP=1 x PP=1.

    Both reshards the suite checks, in one chain of three jobs (they were two runs of two jobs
    each): virtual stages -> TP=2 x PP=2 (every chunk's layers restart at local index 0, so
    this catches keys that collide across chunks; loading at TP=2 x PP=2 reshards on the way
    in), and TP=2 x PP=2 -> TP=1. Each reshard is followed by steps whose losses are compared
    with the uninterrupted run's, and a weight a reshard got wrong stays wrong in the final
    weights (a later step adds an update to it; it does not restore what was lost), which are
    compared too: same bounds, same claims."""
    reference = _reference_tp1(runs)
    resumed = runs.chained("pp2vpp2_to_tp2pp2_to_tp1",
                           [LAYOUTS["pp2_vpp2"], LAYOUTS["tp2_pp2"], LAYOUTS["tp1"]], [2, 4])
    _assert_resumed_matches(resumed, reference, loss_rel_tol=RESHARD_LOSS_REL_TOL,
                            weight_err=max_entry_rel_err, weight_tol=RESHARD_WEIGHT_REL_TOL)


def test_bf16_sharded_master_state_reshards_from_dp2_to_tp2_pp2(runs):
    reference = runs.run("reference_bf16", 1, BF16)
    resumed = runs.resumed("bf16_dp2_to_tp2pp2", (2, BF16), (4, [*BF16, *TP2, *PP2]),
                           stop_after=3)
    _assert_resumed_matches(resumed, reference, loss_rel_tol=BF16_RESHARD_LOSS_REL_TOL,
                            weight_err=norm_rel_err, weight_tol=BF16_RESHARD_WEIGHT_NORM_REL_TOL)


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_loadable(runs):
    ckpt, run_dir = runs.root / "killed_ckpt", runs.root / "killed"
    env = torchrun_env() | {KILL_DURING_SAVE_ENV: "4"}
    command = runs.torchrun_command(1, ["checkpoint.interval=2"], run_dir, ckpt)
    assert _run_in_own_session(command, env, runs.root / "killed.log") != 0
    names = sorted(p.name for p in ckpt.iterdir())
    assert "iter_0000002" in names and "iter_0000004" not in names
    staged = [p for p in ckpt.iterdir() if p.name.startswith(".staging-iter_0000004")]
    assert len(staged) == 1 and not (staged[0] / MANIFEST).exists()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # Resuming picks step 2 and reproduces the uninterrupted run.
    runs.launch(1, ["checkpoint.resume=true"], run_dir, ckpt)
    assert _losses(run_dir) == _losses(_reference_tp1(runs))
    # The resumed run removed the dead save's staging directory at start-up.
    assert not staged[0].exists()


def _run_in_own_session(command: list[str], env: dict[str, str], log: Path) -> int:
    """Run a job whose worker gets SIGKILLed; then kill what the worker leaves behind.

    dist_checkpointing keeps a multiprocessing manager process for its writers; a SIGKILLed
    trainer cannot shut it down, and the orphan would hold inherited output pipes open forever
    (on a cluster the job's cgroup is killed as a whole). torchrun starts each worker as a
    session leader, so the orphans share the worker's session: the job writes to a file, and
    afterwards every worker session torchrun reports ("pid: N") is killed.
    """
    with open(log, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   cwd=REPO)
        try:
            return process.wait(timeout=300)
        finally:
            process.kill()
            for worker in {int(pid) for pid in re.findall(r"\(pid: (\d+)\)", log.read_text())}:
                try:
                    os.killpg(worker, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _resume_fails(runs: CliRuns, run_dir: Path, ckpt: Path, extra: list[str]) -> str:
    """The stderr of a one-rank resume that must exit nonzero (a forked rank, as every
    :func:`run_torchrun` job; the refusal is the CLI's, whatever started the process)."""
    result = run_torchrun(1, runs.cli_args([*extra, "checkpoint.resume=true"], run_dir, ckpt),
                          timeout_s=300, check=False)
    assert result.returncode != 0
    return result.stderr


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated"])
def test_a_corrupt_checkpoint_is_refused_naming_the_file(damage, runs):
    """A damaged copy of the full run's step-3 checkpoint (the files are checked against the
    manifest before anything of the checkpoint is read, whatever the layout)."""
    _full(runs)
    step_dir = f"iter_{MID_STEP:07d}"
    source = runs.checkpoint_dir("full") / step_dir
    ckpt = runs.root / f"corrupt_{damage}"
    copy = _copy_checkpoint(source, ckpt / step_dir)
    victim = sorted(copy.glob("*.distcp"))[0]
    data = bytearray(victim.read_bytes())
    if damage == "flipped_byte":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    victim.write_bytes(bytes(data))
    stderr = _resume_fails(runs, runs.root / f"run_{damage}", ckpt, [])
    assert victim.name in stderr and "corrupt" in stderr, stderr[-2000:]


def test_verify_false_loads_without_checking_the_manifest_and_resumes_exactly(runs):
    """checkpoint.verify=false skips the hashing, nothing else: a copy of the step-3 checkpoint
    whose manifest records a wrong SHA-256 for one intact file is refused with verification on,
    and with it off resumes to the uninterrupted run's losses and weights, bit for bit."""
    full = _full(runs)
    step_dir = f"iter_{MID_STEP:07d}"
    ckpt = runs.root / "unverified_ckpt"
    copy = _copy_checkpoint(runs.checkpoint_dir("full") / step_dir, ckpt / step_dir)
    manifest = json.loads((copy / MANIFEST).read_text())
    victim = sorted(manifest["files"])[0]
    manifest["files"][victim]["sha256"] = "0" * 64
    (copy / MANIFEST).write_text(json.dumps(manifest))
    stderr = _resume_fails(runs, runs.root / "verified", ckpt, [])
    assert victim in stderr and "corrupt" in stderr, stderr[-2000:]
    run_dir = runs.root / "unverified"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text((full / "metrics.jsonl").read_text())
    nproc, layout = LAYOUTS["dp2_distopt"]
    runs.launch(nproc, [*layout, "checkpoint.resume=true", "checkpoint.verify=false"], run_dir,
                ckpt)
    assert _losses(run_dir) == _losses(full)
    want, got = _weights(full), _weights(run_dir)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_resuming_with_incompatible_logra_settings_is_refused(runs):
    _full(runs)
    stderr = _resume_fails(runs, runs.root / "incompatible", runs.checkpoint_dir("full"),
                           [*DISTOPT, "logra.seed=7", "logra.sketch_rank=16"])
    assert "seed: checkpoint 42 vs run 7" in stderr, stderr[-2000:]
    assert "sketch_rank: checkpoint 8 vs run 16" in stderr, stderr[-2000:]


def test_sigterm_makes_every_rank_checkpoint_and_stop(runs):
    run_dir, ckpt = runs.root / "preempted", runs.root / "preempted_ckpt"
    command = runs.torchrun_command(2, ["train.steps=400"], run_dir, ckpt)
    process = subprocess.Popen(command, env=torchrun_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, cwd=REPO)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.5)
    else:
        process.kill()
        pytest.fail("the run never reached step 2")
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=240)
    last = read_metrics(metrics)[-1]["step"]
    assert last < 400
    assert output.count(f"stopping after step {last} (SIGTERM)") == 2, output[-3000:]
    checkpoint = ckpt / f"iter_{last:07d}"
    assert (checkpoint / MANIFEST).is_file()
    assert json.loads((checkpoint / MANIFEST).read_text())["step"] == last
    # Nothing half-written was left behind.
    assert not [name for name in os.listdir(ckpt) if name.startswith(".staging-")]
