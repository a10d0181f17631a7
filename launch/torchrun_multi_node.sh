#!/usr/bin/env bash
# Several nodes: run this once per node (e.g. `srun --ntasks-per-node=1 ...`); each copy starts
# torchrun with the shared rendezvous and N local processes of `python -m megatron_logra ...`.
#
#   srun --nodes=4 --ntasks-per-node=1 launch/torchrun_multi_node.sh rl configs/x.yaml
#   MASTER_ADDR=n0 NNODES=2 NODE_RANK=1 launch/torchrun_multi_node.sh train configs/x.yaml
set -euo pipefail

SCRIPT_NAME="$(basename "$0")"
DEFAULT_MASTER_PORT=29500

print_help() {
    cat << 'EOF'
usage: torchrun_multi_node.sh [--cpu] [--nproc N] [--dry-run] {train|sft|rl} CONFIG.yaml [MORE.yaml ...] [section.key=value ...]

Runs `python -m megatron_logra SUBCOMMAND CONFIG [MORE.yaml ...] OVERRIDES...` under torchrun on this node as
one of NNODES nodes. Start one copy per node. Prints the torchrun command before running it.

options:
  --cpu        CPU over gloo: hides GPUs (CUDA_VISIBLE_DEVICES=), shares the cores among the
               processes (OMP_NUM_THREADS) and appends parallel.device=cpu
  --nproc N    processes per node (default: NPROC, else the visible GPUs, else 1 on CPU)
  --dry-run    print the command and exit without running it

rendezvous (explicit variables win over the ones derived from Slurm):
  MASTER_ADDR  host of node rank 0     (under srun: first host of SLURM_JOB_NODELIST)
  MASTER_PORT  port on MASTER_ADDR     (default 29500)
  NNODES       number of nodes         (under srun: SLURM_NNODES)
  NODE_RANK    this node, 0..NNODES-1  (under srun: SLURM_NODEID)

environment:
  DEVICE, NPROC, PYTHON, OMP_NUM_THREADS as for torchrun_single_node.sh

exit status: 2 when the configuration is refused (`python -m megatron_logra check`, run before
torchrun starts any rank: a bad value, or rl's vLLM venv unusable); otherwise torchrun's; on SIGTERM (or SIGINT) the signal is forwarded and the status is 0 when
every worker on this node saved a checkpoint and stopped (torchrun alone would exit 1).
EOF
}

source "$(dirname "${BASH_SOURCE[0]}")/launch_args.sh"

# First host of a Slurm hostlist without scontrol: the first top-level entry
# ("gpu[003-005,9],cpu1" -> "gpu[003-005,9]"), each bracket group replaced by its first element
# ("gpu003"). Zero padding is kept because the element is copied as written.
first_host_of_nodelist() {
    local list="$1" entry="" depth=0 i ch
    for (( i = 0; i < ${#list}; i++ )); do
        ch="${list:i:1}"
        case "${ch}" in
            '[') depth=$(( depth + 1 )) ;;
            ']') depth=$(( depth - 1 )) ;;
            ',') [[ ${depth} -eq 0 ]] && break ;;
        esac
        entry+="${ch}"
    done
    local host="" rest group first
    while [[ "${entry}" == *'['* ]]; do
        host+="${entry%%'['*}"
        rest="${entry#*'['}"
        group="${rest%%']'*}"
        first="${group%%,*}"
        host+="${first%%-*}"
        entry="${rest#*']'}"
    done
    echo "${host}${entry}"
}

# Fills SLURM_DERIVED_* when this runs inside a Slurm job step, and checks the step has one task
# per node: with more, several copies would claim the same NODE_RANK.
derive_from_slurm() {
    SLURM_DERIVED_NNODES="" SLURM_DERIVED_NODE_RANK="" SLURM_DERIVED_MASTER_ADDR=""
    [[ -n "${SLURM_JOB_ID:-}" && -n "${SLURM_NNODES:-}" ]] || return 0
    # Only when the node rank comes from Slurm: an explicit NODE_RANK is the caller's business.
    if [[ -z "${NODE_RANK:-}" && -n "${SLURM_NTASKS:-}" && "${SLURM_NTASKS}" != "${SLURM_NNODES}" ]]; then
        usage_error "Slurm started ${SLURM_NTASKS} tasks on ${SLURM_NNODES} nodes; start one per node (srun --ntasks-per-node=1)"
    fi
    SLURM_DERIVED_NNODES="${SLURM_NNODES}"
    SLURM_DERIVED_NODE_RANK="${SLURM_NODEID:-}"
    local nodelist="${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}"
    [[ -n "${nodelist}" ]] || return 0
    if command -v scontrol > /dev/null 2>&1; then
        local hosts
        hosts="$(scontrol show hostnames "${nodelist}")" \
            || usage_error "scontrol show hostnames '${nodelist}' failed; set MASTER_ADDR to the host of node rank 0"
        SLURM_DERIVED_MASTER_ADDR="${hosts%%$'\n'*}"
    else
        SLURM_DERIVED_MASTER_ADDR="$(first_host_of_nodelist "${nodelist}")"
    fi
}

parse_launch_args "$@"
derive_from_slurm

NNODES="${NNODES:-${SLURM_DERIVED_NNODES}}"
NODE_RANK="${NODE_RANK:-${SLURM_DERIVED_NODE_RANK}}"
MASTER_ADDR="${MASTER_ADDR:-${SLURM_DERIVED_MASTER_ADDR}}"
MASTER_PORT="${MASTER_PORT:-${DEFAULT_MASTER_PORT}}"

[[ -n "${NNODES}" ]] || usage_error "NNODES is not set and this is not a Slurm job step; set NNODES or run under srun"
is_positive_int "${NNODES}" || usage_error "NNODES=${NNODES} must be a positive integer"
[[ -n "${NODE_RANK}" ]] || usage_error "NODE_RANK is not set and this is not a Slurm job step; set NODE_RANK (0..NNODES-1) or run under srun"
[[ "${NODE_RANK}" =~ ^[0-9]+$ && "${NODE_RANK}" -lt "${NNODES}" ]] \
    || usage_error "NODE_RANK=${NODE_RANK} must be an integer in 0..$(( NNODES - 1 )) (NNODES=${NNODES})"
[[ -n "${MASTER_ADDR}" ]] || usage_error "MASTER_ADDR is not set and SLURM_JOB_NODELIST is not available; set MASTER_ADDR to the host of node rank 0"
[[ "${MASTER_PORT}" =~ ^[0-9]+$ && "${MASTER_PORT}" -ge 1 && "${MASTER_PORT}" -le 65535 ]] \
    || usage_error "MASTER_PORT=${MASTER_PORT} must be a port number in 1..65535"

preflight_check "$(( NNODES * NPROC ))"
# Static rendezvous: node ranks are fixed by the scheduler, so every node must agree on them and
# on the master; torchrun then numbers global ranks node by node.
run_or_print "${ENV_PREFIX[@]}" "${PYTHON_BIN}" -m torch.distributed.run \
    "--nnodes=${NNODES}" "--node_rank=${NODE_RANK}" "--nproc_per_node=${NPROC}" \
    "--master_addr=${MASTER_ADDR}" "--master_port=${MASTER_PORT}" "${TRAINER_ARGS[@]}"
