#!/usr/bin/env bash
# The GPU check a lent device runs in one command (under 8 minutes on one node):
#   tools/gpu_check.sh [OUT_DIR]          # default runs/gpu_check
# NCCL + bf16 parity of LoGRA at TP=2 vs TP=1, the Transformer Engine spec vs the local one,
# torch.cuda.max_memory_allocated of dense Adam / LoRA / LoGRA beside the estimator, the master
# merge on the GPU; vLLM (not built yet) is reported as skipped. A section whose prerequisite is
# missing (CUDA, a second GPU, TE) prints "skipped: <why>" and the check goes on; the exit status
# is non-zero only when a section that ran failed. Figures: OUT_DIR/figures.jsonl (JSON lines),
# OUT_DIR/summary.txt (the same in words). The sections live in tools/gpu_check.py.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Resolve OUT_DIR against the caller's directory before moving to the repository root.
OUT="$(realpath -m "${1:-$REPO/runs/gpu_check}")"
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

echo "GPU check -> $OUT"
exec "$PYTHON" tools/gpu_check.py all --out "$OUT"
