"""The GPU check's policy-sync sections (tools/gpu_check.py runs them; docs/gpu_check.md).

* ``sync_megatron``: the RL job (``configs/demo_rl_cpu.yaml`` at TP=1 on GPU 0) with the built-in
  Megatron engine on its own GPU (``rollout.devices=[1]``), kept in step by low-rank sync over the
  NCCL channel (``sync.transport=collective``), every step's served weights checked against the
  trainer's; then the same run with ``sync.mode=full``: bytes and sync time per step of both;
  then the low-rank run one step off policy (``rollout.max_staleness=1``, the broadcasts from
  the thread that calls the engine): staleness and the weight check of every step.
* ``vllm``: CUDA vLLM (its own venv, ``.venv-vllm-cuda``, which tools/gpu_check.sh sets up with
  ``make setup-vllm-cuda``) with our plugin, low-rank records into its workers over the
  collective channel (NCCL from GPU 0 into vLLM on GPU 1; with one GPU, gloo from the host into
  vLLM on GPU 0), the served weights read back and compared with an exact shadow, log-probs
  compared with Hugging Face transformers on the same weights, bytes and time against a full
  refit (``tools/bench_sync_vllm.py``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gpu_check_common import (
    REPO,
    SectionFailed,
    cuda_missing,
    gpus_missing,
    nccl_missing,
    require,
    run_logged,
    synthetic_data,
    within,
)

RL_CONFIG = REPO / "configs" / "demo_rl_cpu.yaml"
VLLM_CUDA_VENV = REPO / ".venv-vllm-cuda"
SYNC_STEPS = 4
# bf16 (vLLM's production dtype on GPUs): vLLM rounds every layer's activations to bf16, the
# reference (transformers, fp32 on the same bf16 weights) does not: the bound of the CPU vLLM
# test's bf16 comparison (tests/distributed/test_vllm_sync.py, measured 3.9e-3 there).
VLLM_BF16_LOGPROB_TOL = 0.05
# A ~160 M-parameter Llama (8 layers, hidden 1024, 16 query / 8 key-value heads of width 64,
# ffn 2816, vocab 32000) at the paper's sketch rank 256: large enough that the bytes, not the
# per-record overheads, set the time.
VLLM_MODEL = ["--hidden", "1024", "--layers", "8", "--heads", "16", "--kv-heads", "8",
              "--ffn", "2816", "--vocab", "32000", "--sketch-rank", "256", "--updates", "5",
              "--refits", "2", "--dtype", "bfloat16"]
BUDGET_S = {"sync_megatron": 200, "vllm": 240}


def _rl_steps(overrides: list[str], run_dir: Path, deadline: float) -> list[dict[str, Any]]:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    run_logged([sys.executable, "-m", "megatron_logra", "rl", str(RL_CONFIG), *overrides,
                f"run.dir={run_dir}"], deadline, run_dir.parent / f"{run_dir.name}.log")
    with open(run_dir / "metrics.jsonl") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return [r for r in records if "sync_time_s" in r and "step" in r]


def _sync_figures(steps: list[dict[str, Any]]) -> dict[str, Any]:
    return {"steps": len(steps), "weights_match": [r.get("sync_weights_match") for r in steps],
            "sync_bytes_median": statistics.median(r["sync_bytes"] for r in steps),
            "sync_time_s_median": statistics.median(r["sync_time_s"] for r in steps),
            "sync_full_bytes": steps[-1]["sync_full_bytes"],
            "sync_modes": sorted({r.get("sync_mode", "?") for r in steps})}


def sync_megatron(out: Path) -> dict[str, Any]:
    """The Megatron engine on GPU 1 kept equal to a GPU-0 trainer over NCCL by low-rank sync (a
    CUDA trainer's records, issue 21 item 1; the engine replays on its GPU), by delta sync
    (XOR + zstd) and by full sync."""
    require(gpus_missing(2), nccl_missing())
    deadline = time.monotonic() + BUDGET_S["sync_megatron"]
    data = synthetic_data(out, deadline)
    base = ["parallel.device=cuda", "parallel.tp=1", f"data.dir={data}",
            f"train.steps={SYNC_STEPS}", "rl.eval.interval=0", "rl.eval.prompts=8",
            "rl.eval.samples=1", "rollout.placement=separate", "rollout.engine=megatron",
            "rollout.tp=1", "rollout.devices=[1]", "sync.transport=collective",
            "sync.check_interval=1"]
    figures: dict[str, Any] = {"channel": "nccl", "trainer_device": 0, "engine_device": 1}
    for mode in ("low_rank", "delta", "full"):
        steps = _rl_steps([*base, f"sync.mode={mode}"], out / "sync_megatron" / mode, deadline)
        if not steps:
            raise SectionFailed(f"the {mode} run logged no step with sync metrics", figures)
        figures[mode] = _sync_figures(steps)
    # One step off policy (docs/async.md): the records' NCCL broadcasts come from the thread
    # that calls the engine while the trainer computes on GPU 0.
    steps = _rl_steps([*base, "sync.mode=low_rank", "rollout.max_staleness=1"],
                      out / "sync_megatron" / "low_rank_staleness1", deadline)
    figures["low_rank_staleness1"] = {**_sync_figures(steps),
                                      "staleness": [r.get("staleness") for r in steps]}
    if figures["low_rank_staleness1"]["staleness"] != [0] + [1] * (SYNC_STEPS - 1):
        raise SectionFailed("the one-step-off run's batches were not one version stale",
                            figures)
    low, full = figures["low_rank"], figures["full"]
    figures["full_over_low_rank_bytes"] = full["sync_bytes_median"] / low["sync_bytes_median"]
    figures["full_over_low_rank_time"] = full["sync_time_s_median"] / low["sync_time_s_median"]
    figures["delta_over_low_rank_bytes"] = (figures["delta"]["sync_bytes_median"]
                                            / low["sync_bytes_median"])
    unmatched = [mode for mode in ("low_rank", "delta", "full", "low_rank_staleness1")
                 if not all(m is True for m in figures[mode]["weights_match"])]
    if unmatched:
        raise SectionFailed(f"the engine's weights differed from the trainer's after a step of "
                            f"the {', '.join(unmatched)} run(s)", figures)
    return figures


def vllm_cuda_missing() -> str | None:
    if not (VLLM_CUDA_VENV / "bin" / "python").exists():
        return (f"no CUDA vLLM venv ({VLLM_CUDA_VENV.name}): `make setup-vllm-cuda` (run by "
                "tools/gpu_check.sh) installs vllm==0.32.0 where a package registry is reachable")
    return None


def vllm_placement() -> tuple[list[str], str]:
    """bench_sync_vllm's placement flags and the channel they give: vLLM on GPU 1 fed over NCCL
    from GPU 0 when there are two GPUs (and NCCL), else vLLM on GPU 0 fed over gloo from the
    host (NCCL cannot put two ranks of one group on one device)."""
    if gpus_missing(2) is None and nccl_missing() is None:
        return ["--devices", "1", "--channel-device", "cuda"], "nccl"
    return ["--devices", "0", "--channel-device", "cpu"], "gloo (one GPU)"


def vllm(out: Path) -> dict[str, Any]:
    """CUDA vLLM kept in step by low-rank sync over the collective channel."""
    require(cuda_missing(), vllm_cuda_missing())
    deadline = time.monotonic() + BUDGET_S["vllm"]
    placement, channel = vllm_placement()
    stdout = run_logged([sys.executable, "tools/bench_sync_vllm.py", "--venv", str(VLLM_CUDA_VENV),
                         "--transport", "collective", "--logprobs", "--json", *VLLM_MODEL,
                         *placement], deadline, out / "vllm.log")
    figures: dict[str, Any] = {"channel": channel, **json.loads(stdout.strip().splitlines()[-1])}
    figures["full_over_low_rank_bytes"] = (figures["full"]["bytes_per_update"]
                                           / figures["low_rank"]["bytes_per_update"])
    figures["full_over_low_rank_time"] = (figures["full"]["median_s"]
                                          / figures["low_rank"]["median_s"])
    bad = []
    if figures["weights_match"] is not True:
        bad.append("vLLM's served weights differ from the exact shadow's")
    if not within(figures, "logprob_max_abs_diff", figures["logprob_max_abs_diff"],
                  VLLM_BF16_LOGPROB_TOL):
        bad.append(f"log-probs differ by {figures['logprob_max_abs_diff']:.2e} > "
                   f"{VLLM_BF16_LOGPROB_TOL}")
    if bad:
        raise SectionFailed("; ".join(bad), figures)
    return figures


def figure_line(section: str, f: dict[str, Any]) -> str:
    """The section's result in words (what ran, if it ran)."""
    if section == "sync_megatron" and "low_rank" in f and "full" in f:
        low, full = f["low_rank"], f["full"]
        return (f"  {f['channel']}: low-rank {low['sync_bytes_median'] / 1e6:.3f} MB "
                f"{low['sync_time_s_median'] * 1e3:.1f} ms/step vs full "
                f"{full['sync_bytes_median'] / 1e6:.3f} MB {full['sync_time_s_median'] * 1e3:.1f}"
                f" ms/step; delta {f['delta']['sync_bytes_median'] / 1e6:.3f} MB; weights equal "
                f"every step: {all(low['weights_match'])}")
    if section == "vllm" and "low_rank" in f:
        low, full = f["low_rank"], f["full"]
        return (f"  {f['channel']}: low-rank {low['bytes_per_update'] / 1e6:.1f} MB "
                f"{low['median_s']:.3f} s/update vs full refit {full['bytes_per_update'] / 1e6:.1f}"
                f" MB {full['median_s']:.3f} s; weights equal: {f['weights_match']}; log-prob "
                f"diff {f['logprob_max_abs_diff']:.1e} (tolerance {VLLM_BF16_LOGPROB_TOL})")
    return ""


SECTIONS = {"sync_megatron": sync_megatron, "vllm": vllm}
