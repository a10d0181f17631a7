"""Faults through the real CLI, each test asserting what is lost (issue [hardening] item 4).

* ``kill -9`` of one rank in the middle of a run: the surviving rank exits, with an error naming
  the collective timeout and the checkpoint to resume from, within parallel.collective_timeout_s
  (and slack) of the kill; the resume loses at most one checkpoint interval and then reproduces
  the uninterrupted run bit for bit (fp32, CPU, DP=2 with the distributed optimizer).
* SIGTERM to ``launch/torchrun_single_node.sh``: every worker checkpoints and the *script* exits
  0, although torchrun itself exits 1 after forwarding a signal.
* A checkpoint write that fails for lack of space: the previous checkpoint is intact and loads,
  the error says so, and the unfinished save is removed. The failure is real, not injected into
  our code: the ranks run under ``RLIMIT_FSIZE`` (no root needed), so the kernel refuses the
  write of the first checkpoint shard larger than the limit (EFBIG) -- the same failed write(2)
  mid-file that a full disk (ENOSPC) or an exhausted quota (EDQUOT) gives, reaching
  dist_checkpointing's writer processes the same way.
* Grading that fails (every response past math-verify's batch deadline): each RL step goes on,
  those responses scored as incorrect, and the metrics count them (``reward_failed``). How the
  pool recovers from a crashed or hung worker (counted, killed, replaced, the next batch graded)
  is tested on the pool itself in tests/unit/test_rl_rewards.py.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_logra.local_ports import free_port
from megatron_logra.mcore.checkpointing.checkpoint import LATEST_FILE, MANIFEST, checkpoint_name
from megatron_logra.train.metrics import read_metrics
from tests.cli_runs import CliRuns
from tests.layouts import LAYOUTS
from tests.presets import tiny_gpt, tiny_logra_run
from tests.torchrun import REPO, rank_env, run_torchrun, torchrun_env

pytestmark = pytest.mark.distributed

CONFIG = REPO / "configs" / "demo_cpu.yaml"
STEPS = 12
INTERVAL = 4
# Small, so that the survivor's wait is short; far above a step of the tiny model (~0.1 s).
COLLECTIVE_TIMEOUT_S = 10
# Beyond the timeout: the survivor's traceback, the process-group teardown and interpreter exit
# on a loaded 2-core machine.
EXIT_SLACK_S = 30
# Kill once this step is logged: the first checkpoint is complete by then (it is written after
# step INTERVAL's record, before the next step) and most of the run's steps are still ahead.
KILL_AFTER_STEP = INTERVAL + 1
# Above every file the run writes before its first checkpoint (metrics, resolved config: a few
# KB) and the small files of a checkpoint (common.pt, .metadata: < 40 KB); below each model
# shard (~0.5 MB for the 4-layer tiny GPT at DP=2, ~1 MB at DP=1).
FILE_SIZE_LIMIT_BYTES = 128 * 1024
POLL_S = 0.02
START_TIMEOUT_S = 300
LAYOUT = LAYOUTS["dp2_distopt"]
BASE = [
    *tiny_logra_run(STEPS), "train.micro_batch_size=4", "optimizer.lr=0.01",
    "optimizer.lr_warmup_steps=0", "run.save_full_weights=true",
    f"checkpoint.interval={INTERVAL}", f"parallel.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
    *LAYOUT[1],
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic_data_dir) -> CliRuns:
    return CliRuns(tmp_path_factory.mktemp("faults"), "train", CONFIG, BASE, synthetic_data_dir)


def _uninterrupted(runs: CliRuns) -> Path:
    return runs.run("uninterrupted", LAYOUT[0], checkpointed=True)


class _Ranks:
    """The ranks of one job started as torchrun would, each in its own session: a SIGKILLed
    rank leaves dist_checkpointing's writer manager behind, which :meth:`stop` kills too."""

    def __init__(self, runs: CliRuns, name: str, overrides: list[str], *, nproc: int,
                 file_size_limit: int | None = None) -> None:
        self.run_dir, self.ckpt = runs.root / name, runs.checkpoint_dir(name)
        command = [sys.executable, *runs.cli_args(overrides, self.run_dir, self.ckpt)]
        port = free_port()
        self.logs = [runs.root / f"{name}.rank{rank}.log" for rank in range(nproc)]

        def limit() -> None:
            if file_size_limit is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

        # Python ignores SIGXFSZ from start-up on, so an oversized write fails with EFBIG
        # instead of killing the process.
        self.procs = [
            subprocess.Popen(command, cwd=REPO, env=rank_env(rank, nproc, port),
                             stdout=open(log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                             start_new_session=True, preexec_fn=limit)
            for rank, log in enumerate(self.logs)
        ]

    def wait(self, rank: int, timeout_s: float) -> int:
        return self.procs[rank].wait(timeout=timeout_s)

    def output(self, rank: int) -> str:
        return self.logs[rank].read_text()

    def stop(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def _logged_steps(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    return [r["step"] for r in read_metrics(metrics)] if metrics.is_file() else []


def _wait_for_step(run_dir: Path, step: int, ranks: _Ranks) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _logged_steps(run_dir) or _logged_steps(run_dir)[-1] < step:
        if any(p.poll() is not None for p in ranks.procs) or time.monotonic() > deadline:
            ranks.stop()
            pytest.fail(f"the run stopped or stalled before step {step}:\n{ranks.output(0)[-3000:]}")
        time.sleep(POLL_S)


def _assert_same_run(got: Path, want: Path) -> None:
    """Bit-identical losses at every step and bit-identical final weights."""
    losses = [r["loss"] for r in read_metrics(got / "metrics.jsonl")]
    assert _logged_steps(got) == list(range(1, STEPS + 1))
    assert losses == [r["loss"] for r in read_metrics(want / "metrics.jsonl")]
    got_w, want_w = torch.load(got / "full_weights.pt"), torch.load(want / "full_weights.pt")
    assert sorted(got_w) == sorted(want_w)
    for key, tensor in want_w.items():
        assert torch.equal(got_w[key], tensor), key


def test_kill_9_of_one_rank_stops_the_other_within_the_collective_timeout_and_the_resume_loses_at_most_one_interval(  # noqa: E501
    runs,
):
    reference = _uninterrupted(runs)
    ranks = _Ranks(runs, "killed", [], nproc=2)
    try:
        _wait_for_step(ranks.run_dir, KILL_AFTER_STEP, ranks)
        os.kill(ranks.procs[1].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        code = ranks.wait(0, COLLECTIVE_TIMEOUT_S + EXIT_SLACK_S)
        survivor_s = time.monotonic() - killed_at
    finally:
        ranks.stop()
    survivor = ranks.output(0)
    assert code != 0, survivor[-3000:]
    assert survivor_s <= COLLECTIVE_TIMEOUT_S + EXIT_SLACK_S
    assert f"parallel.collective_timeout_s={COLLECTIVE_TIMEOUT_S} s" in survivor, survivor[-3000:]
    assert "rank 0 of 2 failed during step" in survivor, survivor[-3000:]
    logged = _logged_steps(ranks.run_dir)[-1]
    assert logged < STEPS  # the kill landed mid-run
    newest = int((ranks.ckpt / LATEST_FILE).read_text())
    assert f"newest complete checkpoint: {ranks.ckpt / checkpoint_name(newest)}" in survivor
    # What the crash cost: the steps logged after the newest complete checkpoint.
    assert 0 <= logged - newest <= INTERVAL, (logged, newest)

    runs.launch(LAYOUT[0], ["checkpoint.resume=true"], ranks.run_dir, ranks.ckpt)
    _assert_same_run(ranks.run_dir, reference)


def test_sigterm_to_the_launch_script_checkpoints_every_worker_and_exits_0(runs):
    run_dir, ckpt = runs.root / "preempted", runs.root / "preempted_ckpt"
    env = {**torchrun_env(), "PYTHON": sys.executable}
    # The launch script's own tests use the 1-layer model; many steps so SIGTERM lands mid-run.
    command = [
        "bash", str(REPO / "launch" / "torchrun_single_node.sh"), "--cpu", "--nproc", "2",
        "train", str(CONFIG), *tiny_gpt(num_layers=1), "train.steps=400",
        f"data.dir={runs.data_dir}", f"run.dir={run_dir}", f"checkpoint.dir={ckpt}",
    ]
    log = runs.root / "preempted.log"
    with open(log, "w") as out:
        script = subprocess.Popen(command, cwd=REPO, env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(_logged_steps(run_dir)) < 2:
            if script.poll() is not None or time.monotonic() > deadline:
                script.kill()
                pytest.fail(f"the run stopped or stalled before step 2:\n{log.read_text()[-3000:]}")
            time.sleep(POLL_S)
        script.send_signal(signal.SIGTERM)
        code = script.wait(timeout=START_TIMEOUT_S)
    output = log.read_text()
    assert code == 0, output[-3000:]
    assert "all 2 workers saved a checkpoint" in output
    last = _logged_steps(run_dir)[-1]
    assert last < 400
    assert output.count(f"stopping after step {last} (SIGTERM)") == 2, output[-3000:]
    assert (ckpt / checkpoint_name(last) / MANIFEST).is_file()
    assert int((ckpt / LATEST_FILE).read_text()) == last


def test_a_save_that_runs_out_of_space_leaves_the_previous_checkpoint_intact_and_loadable(runs):
    _uninterrupted(runs)
    name, previous = "out_of_space", INTERVAL
    ckpt = runs.checkpoint_dir(name)
    shutil.copytree(runs.checkpoint_dir("uninterrupted") / checkpoint_name(previous),
                    ckpt / checkpoint_name(previous))
    (ckpt / LATEST_FILE).write_text(f"{previous}\n")
    before = {p.name: p.read_bytes() for p in (ckpt / checkpoint_name(previous)).iterdir()}

    # One rank (resharded from DP=2): the save fails the same way on every rank.
    ranks = _Ranks(runs, name, ["checkpoint.resume=true"], nproc=1,
                   file_size_limit=FILE_SIZE_LIMIT_BYTES)
    try:
        code = ranks.wait(0, START_TIMEOUT_S)
    finally:
        ranks.stop()
    output = ranks.output(0)
    assert code == 1, output[-3000:]
    failed = checkpoint_name(previous + INTERVAL)
    assert f"could not write checkpoint {failed}" in output, output[-3000:]
    assert "The unfinished save was removed" in output, output[-3000:]
    assert f"The newest complete checkpoint, {checkpoint_name(previous)}, is untouched" in output
    # Nothing of the failed save is left, and the previous checkpoint is byte for byte the same.
    assert sorted(p.name for p in ckpt.iterdir()) == sorted([checkpoint_name(previous),
                                                              LATEST_FILE])
    assert {p.name: p.read_bytes() for p in (ckpt / checkpoint_name(previous)).iterdir()} == before
    assert int((ckpt / LATEST_FILE).read_text()) == previous
    # And it loads: dist_checkpointing reads every weight of it (a resume from such a
    # checkpoint reproducing the uninterrupted run is the kill -9 test's claim).
    digest = subprocess.run(
        [sys.executable, str(REPO / "tools" / "checkpoint_digest.py"),
         str(ckpt / checkpoint_name(previous))],
        env=torchrun_env(), capture_output=True, text=True, timeout=START_TIMEOUT_S, cwd=REPO,
    )
    assert digest.returncode == 0, digest.stderr[-3000:]
    assert digest.stdout.strip().splitlines()[-1].startswith("digest ")


# Far below the time math-verify takes to grade one response (~1 ms at best): every response of
# every batch is still ungraded at the deadline.
EXPIRED_BATCH_TIMEOUT_S = 1e-6
RL_STEPS = 2
RL_PROMPTS = 8


def test_rl_steps_go_on_when_grading_fails_scoring_the_responses_as_failed_and_counting_them(
    synthetic_data_dir, tmp_path
):
    run_dir = tmp_path / "rl"
    run_torchrun(1, [
        "-m", "megatron_logra", "rl", str(REPO / "configs" / "demo_rl_cpu.yaml"),
        "parallel.device=cpu", "parallel.tp=1", *tiny_gpt(), f"train.steps={RL_STEPS}",
        "train.micro_batch_size=4", f"rl.prompts_per_step={RL_PROMPTS}",
        "rl.samples_per_prompt=1", "rl.sampling.max_new_tokens=5", "rl.eval.interval=0",
        "rl.eval.prompts=4", "rl.eval.samples=1",
        "rl.reward.name=math_verify", "rl.reward.math_verify.num_workers=1",
        f"rl.reward.math_verify.batch_timeout_s={EXPIRED_BATCH_TIMEOUT_S}",
        f"data.dir={synthetic_data_dir}", f"run.dir={run_dir}",
    ])
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in records] == list(range(1, RL_STEPS + 1))
    for record in records:
        # Every response failed to grade, was scored as incorrect, and the step still ran.
        assert record["reward_failed"] == RL_PROMPTS, record
        assert record["accuracy"] == 0.0 and record["reward"] == 0.0
