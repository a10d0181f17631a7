#!/usr/bin/env bash
# One node, N processes: `torchrun --standalone` around `python -m megatron_logra ...`.
#
#   launch/torchrun_single_node.sh train configs/demo_cpu.yaml optimizer.name=logra   # all GPUs
#   launch/torchrun_single_node.sh --cpu --nproc 2 train configs/demo_cpu.yaml        # gloo
set -euo pipefail

SCRIPT_NAME="$(basename "$0")"

print_help() {
    cat << 'EOF'
usage: torchrun_single_node.sh [--cpu] [--nproc N] [--dry-run] {train|sft|rl} CONFIG.yaml [MORE.yaml ...] [section.key=value ...]

Runs `python -m megatron_logra SUBCOMMAND CONFIG [MORE.yaml ...] OVERRIDES...` under torchrun on this node.

options:
  --cpu        CPU over gloo: hides GPUs (CUDA_VISIBLE_DEVICES=), shares the cores among the
               processes (OMP_NUM_THREADS) and appends parallel.device=cpu
  --nproc N    processes to start (default: NPROC, else the visible GPUs, else 1 on CPU)
  --dry-run    print the command and exit without running it

environment:
  DEVICE           cpu or gpu (default gpu); DEVICE=cpu is the same as --cpu
  NPROC            processes to start when --nproc is not given
  PYTHON           interpreter with megatron_logra installed (default: python on PATH)
  OMP_NUM_THREADS  threads per process on CPU (default: cores / processes)

exit status: 2 when the configuration is refused (`python -m megatron_logra check`, run before
torchrun starts any rank: a bad value, or rl's vLLM venv unusable); otherwise torchrun's; on SIGTERM (or SIGINT) the signal is forwarded and the status is 0 when
every worker on this node saved a checkpoint and stopped (torchrun alone would exit 1).
EOF
}

source "$(dirname "${BASH_SOURCE[0]}")/launch_args.sh"
parse_launch_args "$@"

preflight_check "${NPROC}"
# --standalone: a local rendezvous on a free port, so concurrent jobs on one machine never clash.
run_or_print "${ENV_PREFIX[@]}" "${PYTHON_BIN}" -m torch.distributed.run --standalone \
    "--nproc_per_node=${NPROC}" "${TRAINER_ARGS[@]}"
