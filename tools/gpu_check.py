"""The checks a lent GPU runs: NCCL/bf16 layout parity, the TE spec, measured memory, the merge.

    tools/gpu_check.sh [OUT_DIR]                        # everything, ~5-8 minutes on one node
    python tools/gpu_check.py all --out runs/gpu_check  # the same, without the shell wrapper
    python tools/gpu_check.py tp_parity --out DIR       # one section
    python tools/gpu_check.py sync_megatron vllm --out DIR   # several

Each section checks its own prerequisites first (a CUDA device; two of them for TP=2; NCCL;
Transformer Engine) and, where one is missing, records ``skipped: <why>`` instead of failing, so
the check runs to the end on any machine and says what it could not measure. A section that ran
either passes (every compared figure within its named tolerance) or fails (the figure and the
tolerance are in the record). ``OUT_DIR/figures.jsonl`` holds one JSON record per section
(``section``, ``status``, ``reason``, ``figures``, ``seconds``) after an ``environment`` record;
``OUT_DIR/summary.txt`` the same in words. The exit status is 1 when a section failed, else 0
(skips included).

Sections (one function each, returning its figures):

* ``tp_parity``: the tiny GPT trained by LoGRA through the CLI at TP=1 (one GPU) and TP=2 (two
  GPUs, NCCL), in fp32 and in bf16: per-step losses and final weights compared;
* ``te_spec``: ``model.attention=te`` against ``model.attention=local``, bf16, a few steps: losses;
* ``te_packed``: ``sft`` on prompt data with ``model.attention=te``, train.packing on against off
  (Megatron's thd ``PackedSeqParams`` into TE's fused attention), bf16: losses;
* ``memory``: ``tools/bench_methods.py --device cuda`` on a ~1B-shaped GPT at 4096 tokens:
  ``torch.cuda.max_memory_allocated`` of dense Adam, LoRA and LoGRA beside the estimator's total;
* ``context_parallel``: the tiny GPT at CP=2 (two GPUs, NCCL) against CP=1: the ``sdpa``
  all-gather attention on CUDA's kernels (bottom-right causal bias) under LoGRA's paper mode
  with KL control, fp32 and bf16 (losses, alpha, weights); and, with Transformer Engine, TE's
  own context parallelism (``parallel.cp_comm_type`` p2p and all_gather) against TE at CP=1;
  and ``sft`` on prompt data packed (train.packing) at CP=2 against packed at CP=1, fp32 (the
  packed rows' per-sequence chunk split and its attention on CUDA's kernels);
* ``master_merge``: ``tools/bench_master_merge.py --device cuda``: one merge per master store,
  and whether the stores' masters agree bit for bit after 3 merges;
* ``kl_probe``: ``tools/bench_kl_probe.py --device cuda`` (paper mode under KL control, a
  ~1B-shaped GPT, one 8192-token sequence, bf16): the streamed probe's passes allocate less
  than the step's forward and backward; the pass's time against a forward, the probe's share;
* ``sync_megatron``: the RL job's Megatron engine on its own GPU kept in step by low-rank sync
  over the NCCL channel; bytes and sync time against full sync (tools/gpu_check_sync.py);
* ``vllm``: CUDA vLLM (``.venv-vllm-cuda``) kept in step by low-rank sync over the collective
  channel: weights read back, log-probs, bytes and time against a full refit
  (tools/gpu_check_sync.py).

Nothing here imports Megatron (only ``megatron_logra/mcore`` does): sections run the CLI and the
benchmark tools as subprocesses, so the driver itself starts in about a second on any machine.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gpu_check_sync
import torch
from gpu_check_common import (
    REPO,
    SectionFailed,
    SectionSkipped,
    cuda_missing,
    gpus_missing,
    nccl_missing,
    require,
    run_logged,
    synthetic_data,
    te_missing,
    within,
)

FIGURES_FILE = "figures.jsonl"
SUMMARY_FILE = "summary.txt"
TINY_CONFIG = REPO / "configs" / "demo_cpu.yaml"

# --- tolerances (relative: max |a - b| / max |b|, losses per step) -----------------------------
# fp32 TP=2 vs TP=1 on CPU agrees to 1.3e-7 in loss. On a GPU cuBLAS chooses kernels (split-K
# orders) per shape, so a TP shard's matmul and the row-parallel all-reduce of two partial sums
# round differently from the TP=1 matmul: ~1e-7 per operation, grown over the steps. 1e-5 is
# ~100x the CPU figure and still catches a wrong shard, slice of A or reduction (those are O(1)).
FP32_TP_LOSS_RTOL = 1e-5
FP32_TP_WEIGHT_RTOL = 1e-4
# bf16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3). At TP=2 every row-parallel layer
# rounds its partial output to bf16 before the all-reduce, one rounding more than TP=1, in each of
# 2 layers x 2 row-parallel linears; 2e-2 is ~5 units of roundoff in the loss.
BF16_TP_LOSS_RTOL = 2e-2
# bf16 weights cast from exact fp32 masters: a master that differs by rounding can land one bf16
# ulp (2^-7 relative) away; two ulps of the largest weight.
BF16_TP_WEIGHT_RTOL = 1.6e-2
# TE's fused attention and fused RMSNorm accumulate in other orders than Megatron's local
# attention and torch's norm, with bf16 intermediates: the same bf16 argument as above.
TE_LOSS_RTOL = 2e-2

# Packed vs padded rows on TE, bf16: on CPU (sdpa, RL at DP=2) they agree to 1.5e-4 in loss over 3
# steps; TE's thd kernel and its padded causal kernel block the sums differently, with bf16
# intermediates: the bf16 argument above. A sequence attending across its pack's neighbours
# would move the loss by far more (O(1) per token).
TE_PACKED_LOSS_RTOL = 2e-2
PROMPT_CONFIG = REPO / "configs" / "demo_rl_cpu.yaml"

PARITY_STEPS = 5
TE_STEPS = 5
# ~1B-shaped (TinyLlama-like widths, multi-head attention): 16 layers, hidden 2048, ffn 5632,
# vocab 32000 -> 0.95e9 parameters; one sequence of 4096 tokens; LoGRA and LoRA at rank 256.
MEMORY_MODEL = ["--layers", "16", "--hidden", "2048", "--heads", "16", "--ffn", "5632",
                "--vocab", "32000", "--seq-length", "4096", "--micro-batch-size", "1",
                "--sketch-rank", "256"]
MERGE_SHAPES = ((4096, 4096), (28672, 4096))  # a square projection; a 7B-sized fused fc1
# Seconds each section may run (the sync sections have their own, 440 s together:
# tools/gpu_check_sync.py). A device command may run 10 minutes, so docs/gpu_check.md splits
# the sections into commands whose budgets fit: tp_parity te_spec te_packed memory master_merge
# (540 s); moe_grouped context_parallel kl_probe (470 s); sync_megatron vllm (440 s).
# memory gets most: bench_methods starts 4 processes, and the model's layout-invariant
# initialisation draws every full weight from a CPU generator (1e9 normals per model).
BUDGET_S = {"tp_parity": 130, "te_spec": 70, "te_packed": 70, "memory": 240,
            "master_merge": 30, "moe_grouped": 60, "context_parallel": 260, "kl_probe": 150}
# CP=2 vs CP=1 changes the order of sums as TP=2 does -- each chunk's softmax over the gathered
# keys, the keys' gradients reduce-scattered, the DP x CP reduction of sketches -- so the
# tp_parity bounds apply; alpha is sqrt(budget / m) with m a float64 mean of squared tangents:
# half m's relative error, taken as the loss's bound.
CP_PARITY = {"fp32": (FP32_TP_LOSS_RTOL, FP32_TP_WEIGHT_RTOL),
             "bf16": (BF16_TP_LOSS_RTOL, BF16_TP_WEIGHT_RTOL)}
# The host store's masters against dp_sharded's after bench_master_merge's 3 merges. On CPU they
# are bit-identical (the 192-row chunk alignment). cuBLAS may pick another kernel for a chunk's
# row count than for the whole block, rounding a product -lr (D A)_ij differently by an ulp of
# the product (~1e-3 of the master): the sum into the master then differs by at most 1 ulp of the
# master per merge. (remainder computes the very GEMM dp_sharded does on the bit-identical fp32
# master it reconstructs: any difference there fails the section.)
HOST_MERGE_MAX_ULPS_PER_MERGE = 1
# The streamed KL probe: the memory section's ~1B shape at one 8192-token sequence in bf16,
# paper mode under KL control (the probe is the whole sequence).
KL_PROBE_MODEL = ["--layers", "16", "--hidden", "2048", "--heads", "16", "--ffn", "5632",
                  "--vocab", "32000", "--seq-length", "8192", "--sketch-rank", "256",
                  "--dtype", "bf16"]
# Grouped bf16 expert sketches vs the fp32 per-expert loop: bf16 inputs and one bf16 rounding of
# each P and S entry (2^-8 relative), summed over hundreds of tokens (the CPU run: 2.3e-3).
GROUPED_SKETCH_BF16_REL = 2e-2


@dataclass
class Record:
    section: str
    status: str  # "ok", "skipped" or "failed"
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def line(self) -> str:
        text = f"{self.section:<14}{self.status}"
        return text + (f": {self.reason}" if self.reason else "")


def _cli_train(nproc: int, overrides: list[str], run_dir: Path, deadline: float, *,
               command: str = "train", config: Path = TINY_CONFIG) -> Path:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command = [*launcher, "-m", "megatron_logra", command, str(config), *overrides,
               f"run.dir={run_dir}"]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    run_logged(command, deadline, run_dir.parent / f"{run_dir.name}.log")
    return run_dir


def _losses(run_dir: Path) -> list[float]:
    with open(run_dir / "metrics.jsonl") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return [float(r["loss"]) for r in records if "loss" in r]


def _loss_rel_diff(got: list[float], want: list[float]) -> float:
    if len(got) != len(want) or not want:
        raise SectionFailed(f"runs logged {len(got)} and {len(want)} losses")
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


def _weight_rel_diff(got_dir: Path, want_dir: Path) -> float:
    got = torch.load(got_dir / "full_weights.pt", map_location="cpu")
    want = torch.load(want_dir / "full_weights.pt", map_location="cpu")
    if sorted(got) != sorted(want):
        raise SectionFailed("the two runs saved different weight names")
    return max(float((got[k].double() - want[k].double()).abs().max()
                     / want[k].double().abs().max().clamp_min(1e-30)) for k in want)


# ----------------------------------------------------------------------------- sections


def tp_parity(out: Path) -> dict[str, Any]:
    """LoGRA on the tiny GPT at TP=2 over NCCL against TP=1, fp32 and bf16."""
    require(gpus_missing(2), nccl_missing())
    deadline = time.monotonic() + BUDGET_S["tp_parity"]
    data = synthetic_data(out, deadline)
    base = ["parallel.device=cuda", "parallel.sp=false", f"data.dir={data}",
            f"train.steps={PARITY_STEPS}", "train.micro_batch_size=8",
            "train.global_batch_size=16", "optimizer.name=logra", "run.save_full_weights=true"]
    figures: dict[str, Any] = {}
    bad = []
    for dtype, loss_tol, weight_tol in (("fp32", FP32_TP_LOSS_RTOL, FP32_TP_WEIGHT_RTOL),
                                        ("bf16", BF16_TP_LOSS_RTOL, BF16_TP_WEIGHT_RTOL)):
        runs = {tp: _cli_train(tp, [*base, f"parallel.tp={tp}", f"model.params_dtype={dtype}"],
                               out / "tp_parity" / f"{dtype}_tp{tp}", deadline) for tp in (1, 2)}
        figures[f"{dtype}_losses_tp1"] = _losses(runs[1])
        figures[f"{dtype}_losses_tp2"] = _losses(runs[2])
        loss = _loss_rel_diff(figures[f"{dtype}_losses_tp2"], figures[f"{dtype}_losses_tp1"])
        weight = _weight_rel_diff(runs[2], runs[1])
        if not within(figures, f"{dtype}_loss_rel_diff", loss, loss_tol):
            bad.append(f"{dtype} loss differs by {loss:.2e} > {loss_tol:.0e}")
        if not within(figures, f"{dtype}_weight_rel_diff", weight, weight_tol):
            bad.append(f"{dtype} weights differ by {weight:.2e} > {weight_tol:.0e}")
    if bad:
        raise SectionFailed("; ".join(bad), figures)
    return figures


def te_spec(out: Path) -> dict[str, Any]:
    """The Transformer Engine layer spec against Megatron's local spec: bf16, LoGRA, TP=1."""
    require(cuda_missing(), te_missing())
    deadline = time.monotonic() + BUDGET_S["te_spec"]
    data = synthetic_data(out, deadline)
    base = ["parallel.device=cuda", "parallel.tp=1", "parallel.sp=false", f"data.dir={data}",
            f"train.steps={TE_STEPS}", "train.micro_batch_size=8", "train.global_batch_size=16",
            "optimizer.name=logra", "model.params_dtype=bf16", "run.save_full_weights=true"]
    runs = {kind: _cli_train(1, [*base, f"model.attention={kind}"], out / "te_spec" / kind,
                             deadline) for kind in ("local", "te")}
    figures: dict[str, Any] = {"losses_local": _losses(runs["local"]),
                               "losses_te": _losses(runs["te"])}
    loss = _loss_rel_diff(figures["losses_te"], figures["losses_local"])
    # Both specs share parameter names, so the weights compare directly (reported, not asserted:
    # the claim is the losses').
    figures["weight_rel_diff"] = _weight_rel_diff(runs["te"], runs["local"])
    figures["transformer_engine"] = importlib.metadata.version("transformer_engine")
    if not within(figures, "loss_rel_diff", loss, TE_LOSS_RTOL):
        raise SectionFailed(f"te loss differs from local by {loss:.2e} > {TE_LOSS_RTOL:.0e}",
                            figures)
    return figures


def te_packed(out: Path) -> dict[str, Any]:
    """Packed sequences on the Transformer Engine spec (thd ``PackedSeqParams`` into TE's fused
    attention): ``sft`` on prompt data with train.packing on against off, bf16, LoGRA."""
    require(cuda_missing(), te_missing())
    deadline = time.monotonic() + BUDGET_S["te_packed"]
    data = synthetic_data(out, deadline)
    base = ["parallel.device=cuda", "parallel.tp=1", f"data.dir={data}",
            f"train.steps={TE_STEPS}", "train.micro_batch_size=8", "train.global_batch_size=16",
            "model.attention=te", "model.params_dtype=bf16", "logra.kl_control.enabled=false",
            "run.save_full_weights=true"]
    runs = {}
    for packed in (True, False):
        run_dir = out / "te_packed" / ("packed" if packed else "padded")
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        run_logged([sys.executable, "-m", "megatron_logra", "sft", str(PROMPT_CONFIG), *base,
                    f"train.packing.enabled={str(packed).lower()}", f"run.dir={run_dir}"],
                   deadline, run_dir.parent / f"{run_dir.name}.log")
        runs[packed] = run_dir
    figures: dict[str, Any] = {"losses_packed": _losses(runs[True]),
                               "losses_padded": _losses(runs[False])}
    loss = _loss_rel_diff(figures["losses_packed"], figures["losses_padded"])
    figures["weight_rel_diff"] = _weight_rel_diff(runs[True], runs[False])
    if not within(figures, "loss_rel_diff", loss, TE_PACKED_LOSS_RTOL):
        raise SectionFailed(f"packed te loss differs from padded by {loss:.2e} > "
                            f"{TE_PACKED_LOSS_RTOL:.0e}", figures)
    return figures


def memory(out: Path) -> dict[str, Any]:
    """Measured peak (torch.cuda.max_memory_allocated) of dense Adam, LoRA and LoGRA on a
    ~1B-shaped GPT at 4096 tokens, fp32 (what bench_methods and its estimate measure), beside the
    estimator's per-GPU total."""
    require(cuda_missing())
    deadline = time.monotonic() + BUDGET_S["memory"]
    stdout = run_logged([sys.executable, "tools/bench_methods.py", "--device", "cuda", *MEMORY_MODEL,
                   "--warmup", "1", "--steps", "2", "--no-kernels", "--json"],
                  deadline, out / "memory.log")
    result = json.loads(stdout[stdout.index("{"):])
    figures: dict[str, Any] = {"model": " ".join(MEMORY_MODEL), "precision": "fp32"}
    for method, r in result["methods"].items():
        figures[method] = {
            "memory_source": r["memory_source"],
            "peak_bytes": r["peak_bytes"],
            "persistent_bytes": r["persistent_bytes"],
            "estimate_total_bytes": r["estimate"]["total_bytes"],
            "estimate_persistent_bytes": r["estimate"]["persistent_bytes"],
            "peak_over_estimate": r["peak_bytes"] / r["estimate"]["total_bytes"],
            "step_time_s": r["step_time_s"],
        }
    figures["ratios"] = result.get("ratios", {})
    return figures


def master_merge(out: Path) -> dict[str, Any]:
    """One LoGRA merge of a bf16 weight through each master store, on the GPU: the time of
    each, and whether the stores' masters agree bit for bit (README: bit-identical on CPU)."""
    require(cuda_missing())
    deadline = time.monotonic() + BUDGET_S["master_merge"]
    figures: dict[str, Any] = {}
    bad = []
    for rows, cols in MERGE_SHAPES:
        stdout = run_logged([sys.executable, "tools/bench_master_merge.py", "--device", "cuda",
                       "--rows", str(rows), "--cols", str(cols), "--sketch-rank", "256",
                       "--json"], deadline, out / f"master_merge_{rows}x{cols}.log")
        result = figures[f"{rows}x{cols}"] = json.loads(stdout)
        agreement, merges = result["agreement"], 3  # bench_master_merge.AGREEMENT_MERGES
        if not agreement["remainder"]["bit_identical"]:
            bad.append(f"{rows}x{cols}: remainder differs from dp_sharded "
                       f"({agreement['remainder']['max_master_ulps']} ulp)")
        if agreement["host"]["max_master_ulps"] > HOST_MERGE_MAX_ULPS_PER_MERGE * merges:
            bad.append(f"{rows}x{cols}: host masters {agreement['host']['max_master_ulps']} "
                       f"ulp from dp_sharded's > {HOST_MERGE_MAX_ULPS_PER_MERGE * merges}")
    if bad:
        raise SectionFailed("; ".join(bad), figures)
    return figures


def moe_grouped(out: Path) -> dict[str, Any]:
    """Per-expert sketches of one 30B-A3B-like MoE layer as two grouped GEMMs (docs/moe.md), on
    the GPU in bf16, against the fp32 per-expert loop; times beside the dense grouped wgrad."""
    require(cuda_missing())
    if not hasattr(torch, "_grouped_mm"):
        raise SectionSkipped(f"torch {torch.__version__} has no torch._grouped_mm")
    deadline = time.monotonic() + BUDGET_S["moe_grouped"]
    stdout = run_logged([sys.executable, "tools/bench_grouped_sketch.py", "--device", "cuda",
                         "--dtype", "bf16", "--json"], deadline, out / "moe_grouped.log")
    figures = json.loads(stdout)
    figures["grouped_rel_error_tolerance"] = GROUPED_SKETCH_BF16_REL
    bad = []
    if figures["grouped_rel_error"] > GROUPED_SKETCH_BF16_REL:
        bad.append(f"grouped sketch differs from the loop by {figures['grouped_rel_error']:.2e} "
                   f"> {GROUPED_SKETCH_BF16_REL:.0e}")
    if figures["idle_expert_nonzeros"]:
        bad.append(f"the idle expert's sketch has {figures['idle_expert_nonzeros']} nonzeros")
    if bad:
        raise SectionFailed("; ".join(bad), figures)
    return figures


def _metric(run_dir: Path, name: str) -> list[float]:
    with open(run_dir / "metrics.jsonl") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return [float(r[name]) for r in records if name in r]


def context_parallel(out: Path) -> dict[str, Any]:
    """CP=2 over NCCL against CP=1 on the tiny GPT: sdpa (paper mode, KL control) in fp32 and
    bf16; TE's own CP (p2p, all_gather) in bf16 when Transformer Engine is installed."""
    require(gpus_missing(2), nccl_missing())
    deadline = time.monotonic() + BUDGET_S["context_parallel"]
    data = synthetic_data(out, deadline)
    base = ["parallel.device=cuda", "parallel.tp=1", "parallel.sp=false", f"data.dir={data}",
            f"train.steps={PARITY_STEPS}", "train.micro_batch_size=8",
            "train.global_batch_size=16", "optimizer.name=logra", "model.num_query_groups=2",
            "run.save_full_weights=true"]
    paper = ["logra.mode=paper", "logra.kl_control.enabled=true", "logra.update_factor_dtype=fp32"]
    figures: dict[str, Any] = {}
    bad = []
    for dtype, (loss_tol, weight_tol) in CP_PARITY.items():
        runs = {cp: _cli_train(cp, [*base, *paper, f"parallel.cp={cp}",
                                    f"model.params_dtype={dtype}"],
                               out / "context_parallel" / f"sdpa_{dtype}_cp{cp}", deadline)
                for cp in (1, 2)}
        checks = {
            f"sdpa_{dtype}_loss_rel_diff": (_loss_rel_diff(_losses(runs[2]), _losses(runs[1])),
                                            loss_tol),
            f"sdpa_{dtype}_alpha_rel_diff": (_loss_rel_diff(_metric(runs[2], "alpha"),
                                                            _metric(runs[1], "alpha")), loss_tol),
            f"sdpa_{dtype}_weight_rel_diff": (_weight_rel_diff(runs[2], runs[1]), weight_tol),
        }
        for name, (value, tolerance) in checks.items():
            if not within(figures, name, value, tolerance):
                bad.append(f"{name} {value:.2e} > {tolerance:.0e}")
    # Packed rows split per sequence over CP (sft on prompt data: ragged sequences), fp32.
    packed = {cp: _cli_train(cp, [*base, *paper, f"parallel.cp={cp}", "train.packing.enabled=true",
                                  "model.params_dtype=fp32"],
                             out / "context_parallel" / f"sdpa_packed_cp{cp}", deadline,
                             command="sft", config=PROMPT_CONFIG)
              for cp in (1, 2)}
    for name, value, tolerance in (
            ("sdpa_packed_loss_rel_diff", _loss_rel_diff(_losses(packed[2]), _losses(packed[1])),
             FP32_TP_LOSS_RTOL),
            ("sdpa_packed_weight_rel_diff", _weight_rel_diff(packed[2], packed[1]),
             FP32_TP_WEIGHT_RTOL)):
        if not within(figures, name, value, tolerance):
            bad.append(f"{name} {value:.2e} > {tolerance:.0e}")
    if te_missing():
        figures["te"] = f"not run: {te_missing()}"
    else:
        te = [*base, "logra.mode=library", "model.attention=te", "model.params_dtype=bf16"]
        reference = _cli_train(1, te, out / "context_parallel" / "te_cp1", deadline)
        for comm in ("p2p", "all_gather"):
            run = _cli_train(2, [*te, "parallel.cp=2", f"parallel.cp_comm_type={comm}"],
                             out / "context_parallel" / f"te_cp2_{comm}", deadline)
            value = _loss_rel_diff(_losses(run), _losses(reference))
            if not within(figures, f"te_{comm}_loss_rel_diff", value, BF16_TP_LOSS_RTOL):
                bad.append(f"te {comm} loss differs by {value:.2e} > {BF16_TP_LOSS_RTOL:.0e}")
    if bad:
        raise SectionFailed("; ".join(bad), figures)


def kl_probe(out: Path) -> dict[str, Any]:
    """The streamed KL probe on the GPU (tools/bench_kl_probe.py --device cuda): the probe's
    forward-mode pass and the realised-KL pass must allocate less than the step's forward and
    backward (torch.cuda.max_memory_allocated of each phase); the pass's time against a plain
    forward and the probe's share of the step are recorded."""
    require(cuda_missing())
    deadline = time.monotonic() + BUDGET_S["kl_probe"]
    stdout = run_logged([sys.executable, "tools/bench_kl_probe.py", "--device", "cuda",
                         *KL_PROBE_MODEL, "--warmup", "1", "--steps", "2", "--json"],
                        deadline, out / "kl_probe.log")
    figures = json.loads(stdout[stdout.index("{"):])
    figures["model"] = " ".join(KL_PROBE_MODEL)
    if not figures["probe_below_backward"]:
        raise SectionFailed("the KL probe set the step's peak: "
                            f"{figures['peak_allocated_bytes']}", figures)
    return figures


SECTIONS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "tp_parity": tp_parity, "te_spec": te_spec, "te_packed": te_packed, "memory": memory,
    "master_merge": master_merge, "moe_grouped": moe_grouped,
    "context_parallel": context_parallel, "kl_probe": kl_probe, **gpu_check_sync.SECTIONS,
}


# ----------------------------------------------------------------------------- driver


def run_section(name: str, out: Path) -> Record:
    start = time.monotonic()
    try:
        record = Record(name, "ok", figures=SECTIONS[name](out))
    except SectionSkipped as skip:
        record = Record(name, "skipped", str(skip))
    except SectionFailed as failure:
        figures = failure.args[1] if len(failure.args) > 1 else {}
        record = Record(name, "failed", str(failure.args[0]), figures)
    record.seconds = round(time.monotonic() - start, 2)
    return record


def environment() -> dict[str, Any]:
    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    cuda = torch.cuda.is_available()
    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit or None, "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda else [],
        "transformer_engine": version("transformer_engine"), "vllm": version("vllm"),
        "megatron_core": version("megatron-core"),
    }


def _figure_line(record: Record) -> str:
    """The compared figures (with their tolerances) or the measurements, in words. A failed
    section may hold only some of its figures: print what is there."""
    f = record.figures
    if record.section in ("tp_parity", "te_spec", "context_parallel"):
        return "  " + ", ".join(
            f"{name} {value:.1e}" + (f" (tolerance {f[name + '_tolerance']:.0e})"
                                     if name + "_tolerance" in f else "")
            for name, value in f.items() if name.endswith("_rel_diff"))
    if record.section == "memory":
        return "\n".join(
            f"  {m:<11} peak {f[m]['peak_bytes'] / 2**30:7.2f} GiB  estimate "
            f"{f[m]['estimate_total_bytes'] / 2**30:7.2f} GiB  ({f[m]['peak_over_estimate']:.2f}x)"
            for m in ("dense_adam", "lora", "logra") if m in f)
    if record.section in gpu_check_sync.SECTIONS:
        return gpu_check_sync.figure_line(record.section, f)
    if record.section == "moe_grouped" and "grouped_s" in f:
        return (f"  grouped sketch {f['grouped_s'] * 1e3:.2f} ms vs per-expert loop "
                f"{f['loop_s'] * 1e3:.2f} ms vs dense grouped wgrad "
                f"{f['dense_wgrad_s'] * 1e3:.2f} ms; relative error "
                f"{f['grouped_rel_error']:.1e} (tolerance {GROUPED_SKETCH_BF16_REL:.0e})")
    if record.section == "master_merge" and record.status == "ok":
        return "\n".join(f"  {shape}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in
                                                     f[shape]["merge_ms"].items())
                         for shape in f)
    return ""


def write_report(out: Path, env: dict[str, Any], records: list[Record]) -> str:
    with open(out / FIGURES_FILE, "w") as handle:
        handle.write(json.dumps({"section": "environment", "figures": env}) + "\n")
        for record in records:
            handle.write(json.dumps(record.__dict__) + "\n")
    gpus = ", ".join(env["gpus"]) or "none"
    lines = [f"GPU check {env['time_utc']} commit {env['commit']}: torch {env['torch']} "
             f"(CUDA {env['cuda']}), GPUs: {gpus}"]
    for record in records:
        lines.append(record.line())
        detail = _figure_line(record) if record.status != "skipped" else ""
        if detail:
            lines.append(detail)
    failed = [r.section for r in records if r.status == "failed"]
    lines.append(f"{len(records) - len(failed)} of {len(records)} sections passed or skipped"
                 + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    text = "\n".join(lines) + "\n"
    (out / SUMMARY_FILE).write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("section", nargs="+", choices=["all", *SECTIONS])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # the sections' subprocesses run in the repository root
    args.out.mkdir(parents=True, exist_ok=True)
    names = list(SECTIONS) if "all" in args.section else args.section
    records = []
    for name in names:
        records.append(run_section(name, args.out))
        print(records[-1].line(), flush=True)  # noqa: T201
    print(write_report(args.out, environment(), records), end="")  # noqa: T201
    return 1 if any(r.status == "failed" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
