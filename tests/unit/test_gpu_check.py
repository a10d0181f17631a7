"""The GPU check (tools/gpu_check.sh, tools/gpu_check.py) up to the point where a GPU is needed.

On this CPU machine every section must skip with its reason and the check must still succeed and
write its figures and summary; a simulated machine with one GPU must make the TP=2 section say it
needs two (the prerequisite detection is real, not "no CUDA" for everything); a section that ran
and failed must make the check fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tools import load_tool

REPO = Path(__file__).resolve().parents[2]


gpu_check = load_tool("gpu_check")
gpu_check_sync = sys.modules["gpu_check_sync"]  # what gpu_check imported: the one it runs


def _records(out: Path) -> dict[str, dict]:
    lines = (out / gpu_check.FIGURES_FILE).read_text().splitlines()
    return {r["section"]: r for r in map(json.loads, lines)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the check measures for real")
def test_gpu_check_script_without_cuda_exits_0_skipping_every_section_with_its_reason(tmp_path):
    out = tmp_path / "check"
    done = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), str(out)],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    records = _records(out)
    assert list(records) == ["environment", *gpu_check.SECTIONS]
    no_cuda = "no CUDA device (torch.cuda.is_available() is False)"
    expected = {name: no_cuda for name in gpu_check.SECTIONS}
    for name, reason in expected.items():
        assert records[name]["status"] == "skipped"
        assert records[name]["reason"] == reason
        assert records[name]["figures"] == {}
    summary = (out / gpu_check.SUMMARY_FILE).read_text()
    for name, reason in expected.items():
        assert f"{name:<14}skipped: {reason}" in summary
    assert records["environment"]["figures"]["gpus"] == []
    # Nothing was launched: no data, no run directories, only the report and the machine note.
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [gpu_check.FIGURES_FILE, gpu_check.SUMMARY_FILE, "nvidia_smi.txt"])


def test_tp_parity_with_one_gpu_visible_is_skipped_as_needing_two(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    record = gpu_check.run_section("tp_parity", tmp_path)
    assert (record.status, record.reason) == ("skipped", "needs 2 GPUs, 1 visible")
    assert list(tmp_path.iterdir()) == []  # skipped before launching anything


def test_te_section_with_a_gpu_but_no_transformer_engine_is_skipped_for_transformer_engine(
        tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None
                        if name == "transformer_engine" else real_find_spec(name, package))
    record = gpu_check.run_section("te_spec", tmp_path)
    assert record.status == "skipped"
    assert record.reason.startswith("Transformer Engine is not installed")
    assert list(tmp_path.iterdir()) == []


def test_a_section_that_ran_and_failed_makes_the_check_exit_1_with_its_figures(
        tmp_path, monkeypatch):
    def out_of_tolerance(out):
        raise gpu_check.SectionFailed("bf16 loss differs by 5.00e-02 > 2e-02",
                                      {"bf16_loss_rel_diff": 0.05})

    monkeypatch.setitem(gpu_check.SECTIONS, "tp_parity", out_of_tolerance)
    assert gpu_check.main(["tp_parity", "--out", str(tmp_path)]) == 1
    record = _records(tmp_path)["tp_parity"]
    assert record["status"] == "failed"
    assert record["figures"] == {"bf16_loss_rel_diff": 0.05}
    summary = (tmp_path / gpu_check.SUMMARY_FILE).read_text()
    assert "FAILED: tp_parity" in summary
    assert "bf16_loss_rel_diff 5.0e-02" in summary  # the figures it has, even if not all


def _gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_megatron_sync_section_with_one_gpu_is_skipped_as_needing_two(tmp_path, monkeypatch):
    _gpus(monkeypatch, 1)
    record = gpu_check.run_section("sync_megatron", tmp_path)
    assert (record.status, record.reason) == ("skipped", "needs 2 GPUs, 1 visible")
    assert list(tmp_path.iterdir()) == []


def test_context_parallel_section_with_one_gpu_is_skipped_as_needing_two(tmp_path, monkeypatch):
    _gpus(monkeypatch, 1)
    record = gpu_check.run_section("context_parallel", tmp_path)
    assert (record.status, record.reason) == ("skipped", "needs 2 GPUs, 1 visible")
    assert list(tmp_path.iterdir()) == []


def test_vllm_section_with_a_gpu_but_no_cuda_vllm_venv_is_skipped_naming_its_setup(
        tmp_path, monkeypatch):
    _gpus(monkeypatch, 8)
    monkeypatch.setattr(gpu_check_sync, "VLLM_CUDA_VENV", tmp_path / "no-venv")
    record = gpu_check.run_section("vllm", tmp_path / "out")
    assert record.status == "skipped"
    assert record.reason.startswith("no CUDA vLLM venv (no-venv): `make setup-vllm-cuda`")
    assert not (tmp_path / "out").exists()


def test_vllm_section_feeds_gpu1_over_nccl_with_two_gpus_and_gpu0_over_gloo_otherwise(
        monkeypatch):
    _gpus(monkeypatch, 2)
    # This CPU build of torch has no NCCL: with it missing, two GPUs still get the gloo channel.
    assert gpu_check_sync.vllm_placement()[1] == "gloo (one GPU)"
    monkeypatch.setattr(gpu_check_sync, "nccl_missing", lambda: None)  # a CUDA build's NCCL
    assert gpu_check_sync.vllm_placement() == (["--devices", "1", "--channel-device", "cuda"],
                                               "nccl")
    _gpus(monkeypatch, 1)
    assert gpu_check_sync.vllm_placement() == (["--devices", "0", "--channel-device", "cpu"],
                                               "gloo (one GPU)")
