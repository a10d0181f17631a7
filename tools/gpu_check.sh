#!/usr/bin/env bash
# The GPU check a lent device runs in one command (about 14 minutes on one node with everything):
#   tools/gpu_check.sh [OUT_DIR] [SECTION ...]   # default runs/gpu_check, all sections
#   tools/gpu_check.sh runs/gpu_check sync_megatron vllm   # the policy-sync sections (~7 min)
# NCCL + bf16 parity of LoGRA at TP=2 vs TP=1, the Transformer Engine spec vs the local one,
# torch.cuda.max_memory_allocated of dense Adam / LoRA / LoGRA beside the estimator, the master
# merge on the GPU; the Megatron engine and CUDA vLLM kept in step by low-rank sync over the
# NCCL channel (the CUDA vLLM venv is set up first, `make setup-vllm-cuda`, where a package
# registry is reachable; without it the vllm section says so). A section whose prerequisite is
# missing (CUDA, a second GPU, TE) prints "skipped: <why>" and the check goes on; the exit status
# is non-zero only when a section that ran failed. Figures: OUT_DIR/figures.jsonl (JSON lines),
# OUT_DIR/summary.txt (the same in words). The sections live in tools/gpu_check.py.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Resolve OUT_DIR against the caller's directory before moving to the repository root.
OUT="$(realpath -m "${1:-$REPO/runs/gpu_check}")"
shift || true
SECTIONS=("${@:-all}")
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
if [[ ! -x "$PYTHON" ]]; then
    PYTHON="$(command -v python3)"
fi
mkdir -p "$OUT"
cd "$REPO"

# What the machine is, next to the figures (nvidia-smi is absent where there is no driver).
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi > "$OUT/nvidia_smi.txt" 2>&1 || echo "nvidia-smi failed" > "$OUT/nvidia_smi.txt"
else
    echo "no nvidia-smi on this machine" > "$OUT/nvidia_smi.txt"
fi

# vLLM for CUDA in its own venv (its pins conflict with ours); only where there is a GPU, and a
# failed setup (an offline machine) is reported and leaves the vllm section to say it skipped.
if command -v nvidia-smi >/dev/null 2>&1 && [[ ! -e .venv-vllm-cuda/.installed ]]; then
    if [[ " ${SECTIONS[*]} " == *" all "* || " ${SECTIONS[*]} " == *" vllm "* ]]; then
        echo "setting up .venv-vllm-cuda (log: $OUT/setup_vllm_cuda.log)"
        make setup-vllm-cuda > "$OUT/setup_vllm_cuda.log" 2>&1 \
            || echo "CUDA vLLM setup failed (see $OUT/setup_vllm_cuda.log)"
    fi
fi

echo "GPU check -> $OUT"
exec "$PYTHON" tools/gpu_check.py "${SECTIONS[@]}" --out "$OUT"
