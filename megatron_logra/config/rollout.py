"""The ``rollout`` section (where the RL run's rollout engine runs) and the ``sync`` section (how
a separate engine's weights are kept equal to the trainer's; docs/sync.md)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_logra.config.checks import check_choice, check_positive

PLACEMENTS: tuple[str, ...] = ("colocated", "separate")
"""colocated: the trainer's ranks sample with their own weights (nothing to sync); separate: an
engine in its own processes, with its own TP size, kept in step by policy sync."""
ENGINES: tuple[str, ...] = ("megatron", "vllm")
SYNC_MODES: tuple[str, ...] = ("auto", "low_rank", "delta", "full")
"""auto: low_rank for LoGRA (delta where the engine cannot replay merges on the trainer's kind
of device: megatron_logra/sync/replay_device.py), full for every other optimizer."""
ENGINE_START_TIMEOUT_S = 900.0
"""vLLM's start was measured at 24-39 s on a quiet 2-core machine and 156-315 s on a loaded one
(docs/vllm.md); 900 s is well above both (a too short default killed healthy starts)."""
ENGINE_IDLE_BROADCAST_S = 30.0
"""The Megatron engine's rank 0 wakes its other ranks at least this often while the trainer is
busy (they wait in a collective of the engine's world, whose timeout is the trainer's
parallel.collective_timeout_s)."""
SYNC_WIRE_DTYPES: tuple[str, ...] = ("fp32", "bf16")
SYNC_TRANSPORTS: tuple[str, ...] = ("rpc", "collective")
"""rpc: each record's bytes over the engine's control channel (re-sent by a multi-rank engine
to its other ranks); collective: the header over the control channel, the tensor bytes broadcast
from the trainer's rank 0 to every engine rank in a process group of their own (gloo on CPU,
NCCL on CUDA; megatron_logra/sync/transport.py)."""


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Where the RL run generates its rollouts."""

    placement: str = "colocated"
    engine: str = "megatron"
    """The separate engine: the built-in Megatron sampler in its own processes, or vLLM."""
    tp: int = 1
    """The separate engine's own tensor-parallel size (independent of parallel.tp)."""
    start_timeout_s: float = ENGINE_START_TIMEOUT_S
    """A separate engine that has not answered this long after its launch is an error. The
    other trainer ranks wait as long as the start takes (rank 0 sends them heartbeats), not
    parallel.collective_timeout_s."""
    request_timeout_s: float = 600.0
    """One request to a separate engine (a generate, a sync record) that takes longer is an
    error naming the request: never a hang. The other trainer ranks wait as long as rank 0's
    requests take (a full sync is many), not parallel.collective_timeout_s."""
    vllm_venv: str = ""
    """The venv vLLM runs in (rollout.engine=vllm); empty: this checkout's ``.venv-vllm``, which
    ``make setup-vllm`` builds. Checked before any rank starts."""
    devices: list[int] = field(default_factory=list)
    """CUDA device indices (as the machine numbers them) of the separate engine's processes, one
    per engine TP rank, disjoint from the trainer's (the paper's 4 + 4 split of one node:
    ``rollout.devices=[4,5,6,7]`` beside a 4-rank trainer); the engine sees only them
    (CUDA_VISIBLE_DEVICES). Empty: the engine's device follows parallel.device (on CUDA, its
    ranks would take the trainer's first devices)."""
    max_staleness: int = 0
    """How many policy versions (RL steps) a batch may lag the policy it trains: 0 is the
    synchronous loop (generate, then train); N >= 1 lets the separate engine generate the next
    N batches while the trainer updates on the current one (1: one step off policy). Needs
    rollout.placement=separate; docs/async.md."""
    cpus: list[int] = field(default_factory=list)
    """CPU cores of a separate engine on the CPU, one per engine TP rank (engine rank ``r`` is
    pinned to ``cpus[r]``; vLLM binds its worker threads there): keeps the engine off the
    trainer's cores. Empty: the engine's processes run where the trainer's may."""

    def validate(self, path: str = "rollout") -> None:
        check_choice(f"{path}.placement", self.placement, PLACEMENTS)
        check_choice(f"{path}.engine", self.engine, ENGINES)
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"{path}.tp={self.tp!r} must be an integer >= 1 (the engine's "
                             "tensor-parallel size)")
        check_positive(f"{path}.start_timeout_s", self.start_timeout_s)
        if self.devices:
            if len(set(self.devices)) != len(self.devices) or min(self.devices) < 0:
                raise ValueError(f"{path}.devices={self.devices} must be distinct CUDA device "
                                 "indices >= 0")
            if len(self.devices) != self.tp:
                raise ValueError(
                    f"{path}.devices={self.devices} names {len(self.devices)} device(s) for "
                    f"{path}.tp={self.tp} engine rank(s): give one device per engine rank")
        check_positive(f"{path}.request_timeout_s", self.request_timeout_s)
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or \
                self.max_staleness < 0:
            raise ValueError(f"{path}.max_staleness={self.max_staleness!r} must be an integer "
                             ">= 0 (0: synchronous; 1: one step off policy)")
        if self.cpus:
            if len(set(self.cpus)) != len(self.cpus) or min(self.cpus) < 0:
                raise ValueError(f"{path}.cpus={self.cpus} must be distinct CPU core indices "
                                 ">= 0")
            if len(self.cpus) != self.tp:
                raise ValueError(f"{path}.cpus={self.cpus} names {len(self.cpus)} core(s) for "
                                 f"{path}.tp={self.tp} engine rank(s): give one core per "
                                 "engine rank")
        if not isinstance(self.vllm_venv, str):
            raise ValueError(f"{path}.vllm_venv={self.vllm_venv!r} must be a directory path "
                             "(empty: the checkout's .venv-vllm)")
        if self.vllm_venv and self.engine != "vllm":
            raise ValueError(f"{path}.vllm_venv={self.vllm_venv!r} with {path}.engine="
                             f"{self.engine}: only a vLLM engine runs in that venv; set "
                             f"{path}.engine=vllm or drop {path}.vllm_venv")

    @property
    def separate(self) -> bool:
        return self.placement == "separate"


SEPARATE_ENGINE_FIELDS: tuple[str, ...] = (
    "engine", "tp", "start_timeout_s", "request_timeout_s", "vllm_venv", "devices", "cpus")
"""The rollout fields that only act on a separate engine (with rollout.placement=colocated
the trainer's ranks sample with their own weights: nothing is started, placed or waited for)."""


def check_engine_collective_timeout(rollout: RolloutConfig, collective_timeout_s: float) -> None:
    """The Megatron engine's ranks other than 0 wait on its rank 0 in collectives whose timeout
    is the trainer's: a timeout its idle broadcast cannot meet is refused."""
    if rollout.engine == "megatron" and rollout.tp > 1 and \
            collective_timeout_s <= ENGINE_IDLE_BROADCAST_S:
        raise ValueError(
            f"parallel.collective_timeout_s={collective_timeout_s:g} with rollout.engine="
            f"megatron at rollout.tp={rollout.tp}: the engine's ranks wait on its rank 0, which "
            f"wakes them every {ENGINE_IDLE_BROADCAST_S:g} s while the trainer updates, in "
            "collectives with that timeout; raise parallel.collective_timeout_s above "
            f"{ENGINE_IDLE_BROADCAST_S:g} (default 600)")


def _default(section: Any, name: str) -> Any:
    item = next(f for f in dataclasses.fields(section) if f.name == name)
    return item.default_factory() if item.default is dataclasses.MISSING else item.default


def colocated_inert_settings(rollout: RolloutConfig, sync: SyncConfig) -> list[str]:
    """``key=value`` of every setting that would do nothing with colocated rollouts: the
    separate engine's rollout fields and every field of the sync section (whatever it holds)
    that differs from its default."""
    changed = [(f"rollout.{name}", getattr(rollout, name)) for name in SEPARATE_ENGINE_FIELDS
               if getattr(rollout, name) != _default(rollout, name)]
    changed += [(f"sync.{item.name}", getattr(sync, item.name))
                for item in dataclasses.fields(sync)
                if getattr(sync, item.name) != _default(sync, item.name)]
    return [f"{key}={value}" for key, value in changed]


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Policy sync of a separate rollout engine (unused when ``rollout.placement=colocated``)."""

    mode: str = "auto"
    """low_rank: per target the merged factor and the projection's seed after every update,
    changed non-targets dense; delta: the XOR of the served weights' bits against the engine's,
    zstd-compressed, any optimizer; full: every weight after every update (the baseline)."""
    wire_dtype: str = "fp32"
    """dtype of the low-rank factors and dense values on the wire; bf16 is exact only for paper
    mode with logra.update_factor_dtype=bf16 (library mode merges fp32 factors)."""
    full_interval: int = 0
    """A full sync every this many updates (besides the one at start, after a resume and on a
    checksum mismatch); 0: only those."""
    check_interval: int = 10
    """Compare the engine's weight checksums with the trainer's every this many updates (and
    resync fully on a mismatch); 0: never."""
    bucket_bytes: int = 256 * 1024 * 1024
    """A full sync ships the weights in buckets of at most this many bytes."""
    transport: str = "rpc"
    """How a record's bytes reach the engine: rpc or collective (SYNC_TRANSPORTS)."""

    def validate(self, path: str = "sync") -> None:
        check_choice(f"{path}.mode", self.mode, SYNC_MODES)
        check_choice(f"{path}.wire_dtype", self.wire_dtype, SYNC_WIRE_DTYPES)
        check_choice(f"{path}.transport", self.transport, SYNC_TRANSPORTS)
        for name in ("full_interval", "check_interval", "bucket_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{path}.{name}={value!r} must be an integer")
        check_positive(f"{path}.full_interval", self.full_interval, allow_zero=True)
        check_positive(f"{path}.check_interval", self.check_interval, allow_zero=True)
        check_positive(f"{path}.bucket_bytes", self.bucket_bytes)

    def resolved_mode(self, optimizer_name: str) -> str:
        if self.mode != "auto":
            return self.mode
        return "low_rank" if optimizer_name == "logra" else "full"
