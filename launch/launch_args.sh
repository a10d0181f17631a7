# Shared by torchrun_single_node.sh and torchrun_multi_node.sh (sourced, not run): parses the
# common command line and decides device, process count and the megatron_logra command.
#
# After `parse_launch_args "$@"` these are set:
#   DRY_RUN        1 to print the command and not run it
#   USE_CPU        1 for CPU/gloo, 0 for GPU
#   NPROC          processes on this node
#   PYTHON_BIN     the interpreter that runs torch.distributed.run
#   ENV_PREFIX     array: `env VAR=value ...` words put in front of the command (may be empty)
#   TRAINER_ARGS   array: `-m megatron_logra SUBCOMMAND CONFIG [CONFIG...] OVERRIDES...`

SUBCOMMANDS=(train sft rl)

usage_error() {
    echo "${SCRIPT_NAME}: $1" >&2
    echo "usage: ${SCRIPT_NAME} [--cpu] [--nproc N] [--dry-run] {train|sft|rl} CONFIG.yaml [MORE.yaml ...] [section.key=value ...]" >&2
    echo "       (run '${SCRIPT_NAME} --help' for the environment variables it reads)" >&2
    exit 2
}

is_positive_int() {
    [[ "$1" =~ ^[1-9][0-9]*$ ]]
}

# The visible GPUs: CUDA_VISIBLE_DEVICES restricts what nvidia-smi lists, so count it when set.
count_visible_gpus() {
    if [[ -n "${CUDA_VISIBLE_DEVICES+x}" && -n "${CUDA_VISIBLE_DEVICES}" ]]; then
        local -a ids
        IFS=',' read -r -a ids <<< "${CUDA_VISIBLE_DEVICES}"
        echo "${#ids[@]}"
        return
    fi
    if ! command -v nvidia-smi > /dev/null 2>&1; then
        echo 0
        return
    fi
    # nvidia-smi fails (not just prints nothing) when the driver is missing; that means 0 GPUs.
    nvidia-smi -L 2> /dev/null | grep -c '^GPU ' || true
}

parse_launch_args() {
    DRY_RUN=0
    USE_CPU=0
    local nproc_flag=""
    case "${DEVICE:-gpu}" in
        cpu) USE_CPU=1 ;;
        gpu | cuda) USE_CPU=0 ;;
        *) usage_error "DEVICE=${DEVICE} is not valid; use DEVICE=cpu or DEVICE=gpu" ;;
    esac
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --cpu) USE_CPU=1; shift ;;
            --dry-run) DRY_RUN=1; shift ;;
            --nproc)
                [[ $# -ge 2 ]] || usage_error "--nproc needs a value"
                nproc_flag="$2"; shift 2 ;;
            --nproc=*) nproc_flag="${1#--nproc=}"; shift ;;
            -h | --help) print_help; exit 0 ;;
            --) shift; break ;;
            -*) usage_error "unknown option $1" ;;
            *) break ;;
        esac
    done
    [[ $# -ge 2 ]] || usage_error "need a subcommand and a config file"
    local subcommand="$1"
    shift
    local known=0 name
    for name in "${SUBCOMMANDS[@]}"; do
        [[ "${subcommand}" == "${name}" ]] && known=1
    done
    [[ ${known} -eq 1 ]] || usage_error "subcommand '${subcommand}' is not valid; use one of: ${SUBCOMMANDS[*]}"
    # One or more config files (later ones override earlier ones, e.g. a preset then a
    # converted model's model.yaml), then the overrides.
    local -a configs=()
    while [[ $# -gt 0 && "$1" != *=* ]]; do
        [[ -f "$1" ]] || usage_error "config file '$1' does not exist"
        configs+=("$1")
        shift
    done
    [[ ${#configs[@]} -ge 1 ]] || usage_error "need a config file before the overrides"
    local override
    for override in "$@"; do
        [[ "${override}" == *.*=* ]] || usage_error "override '${override}' must look like section.key=value"
        if [[ ${USE_CPU} -eq 1 && "${override}" == parallel.device=* && "${override}" != parallel.device=cpu ]]; then
            usage_error "override '${override}' contradicts --cpu/DEVICE=cpu; drop one of them"
        fi
    done

    # Precedence: --nproc, then NPROC, then the hardware (visible GPUs; one process on CPU).
    NPROC="${nproc_flag:-${NPROC:-}}"
    if [[ -n "${NPROC}" ]]; then
        is_positive_int "${NPROC}" || usage_error "process count '${NPROC}' must be a positive integer (--nproc or NPROC)"
    elif [[ ${USE_CPU} -eq 1 ]]; then
        NPROC=1
    else
        NPROC="$(count_visible_gpus)"
        [[ "${NPROC}" -gt 0 ]] || usage_error "no GPU is visible (nvidia-smi finds none); use --cpu, DEVICE=cpu, or set NPROC"
    fi

    PYTHON_BIN="${PYTHON:-python}"
    command -v "${PYTHON_BIN}" > /dev/null 2>&1 || usage_error "interpreter '${PYTHON_BIN}' not found; set PYTHON to the Python that has megatron_logra installed"

    ENV_PREFIX=()
    TRAINER_ARGS=(-m megatron_logra "${subcommand}" "${configs[@]}" "$@")
    if [[ ${USE_CPU} -eq 1 ]]; then
        # Share the cores among the processes unless the caller chose a thread count: torch
        # otherwise starts one thread per core in every process and they fight for the CPUs.
        local threads="${OMP_NUM_THREADS:-}"
        if [[ -z "${threads}" ]]; then
            local cores
            cores="$(nproc 2> /dev/null || echo 1)"
            threads=$(( cores / NPROC ))
            [[ ${threads} -ge 1 ]] || threads=1
        fi
        # An empty CUDA_VISIBLE_DEVICES hides every GPU, so nothing can pick one up by accident.
        ENV_PREFIX=(env "CUDA_VISIBLE_DEVICES=" "OMP_NUM_THREADS=${threads}")
        TRAINER_ARGS+=(parallel.device=cpu)
    fi
}

# Validates the run's configuration for a world of $1 processes (and, for rl with a vLLM engine,
# the engine's venv) before torchrun starts any rank: a bad value exits with the CLI's status 2
# and its one message, not with torchrun's 1 after a message per rank. Skipped by --dry-run,
# which runs nothing.
preflight_check() {
    [[ ${DRY_RUN} -eq 1 ]] && return 0
    local status=0
    "${ENV_PREFIX[@]}" "${PYTHON_BIN}" -m megatron_logra check "--world-size=$1" \
        "${TRAINER_ARGS[@]:2}" || status=$?
    [[ ${status} -eq 0 ]] || exit "${status}"
}

# The directory in which each worker records that it saved a checkpoint after SIGTERM and
# stopped cleanly (megatron_logra/train/preemption.py writes one file per rank).
PREEMPTION_RECORD_ENV=MEGATRON_LOGRA_PREEMPTION_RECORD_DIR

# Prints the command on one line, quoted so that it can be pasted into a shell, then runs it
# (unless --dry-run) and exits with its status -- with one exception. On SIGTERM (a scheduler's
# preemption) or SIGINT the script forwards the signal to torchrun, which forwards it to the workers; each
# checkpoints and stops, but torchrun itself then exits 1 because it was signalled. When every
# one of this node's NPROC workers recorded a saved checkpoint, the script exits 0 instead (and
# says so); otherwise torchrun's status stands.
run_or_print() {
    local line
    line="$(printf '%q ' "$@")"
    echo "${line% }"
    [[ ${DRY_RUN} -eq 1 ]] && exit 0
    local records
    records="$(mktemp -d -t megatron-logra-preemption.XXXXXX)"
    export "${PREEMPTION_RECORD_ENV}=${records}"
    local signalled=0 child status
    "$@" &
    child=$!
    # SIGINT too: bash starts a background job with SIGINT ignored, so Ctrl-C reaches torchrun
    # only through this trap, as a request to checkpoint and stop.
    trap 'signalled=1; kill -TERM "${child}" 2> /dev/null || true' TERM INT
    # `wait` returns early (status > 128) when a trapped signal arrives: wait until the job exits.
    while true; do
        status=0
        wait "${child}" || status=$?
        kill -0 "${child}" 2> /dev/null || break
    done
    if [[ ${status} -gt 128 ]]; then
        # Maybe the status of the interrupted `wait`, not the job's: ask once more (127: the job
        # was already waited for, and its status is the one we have).
        local again=0
        wait "${child}" 2> /dev/null || again=$?
        [[ ${again} -eq 127 ]] || status=${again}
    fi
    trap - TERM INT
    local saved
    saved="$(find "${records}" -maxdepth 1 -name 'rank-*.saved' | wc -l)"
    rm -rf "${records}"
    if [[ ${signalled} -eq 1 && ${status} -ne 0 && ${saved} -eq ${NPROC} ]]; then
        echo "${SCRIPT_NAME}: signalled: all ${NPROC} workers saved a checkpoint and stopped;" \
            "torchrun's exit status ${status} (it was signalled) is reported as 0" >&2
        exit 0
    fi
    if [[ ${signalled} -eq 1 && ${status} -ne 0 ]]; then
        echo "${SCRIPT_NAME}: signalled: only ${saved} of ${NPROC} workers recorded a saved" \
            "checkpoint; exiting with torchrun's status ${status}" >&2
    fi
    exit "${status}"
}
