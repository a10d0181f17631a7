"""The built-in Megatron sampler as a separate rollout engine (``rollout.engine=megatron``).

:class:`MegatronEngine` is the trainer's end: :meth:`start` launches ``rollout.tp`` engine
processes (``megatron_logra.mcore.inference.engine_server``) with a world of their own (gloo
or NCCL on their own port, their own TP size, pipeline and data parallel 1), which build the
same GPT from the same config, and connects to the engine's rank 0 over a local socket
(``multiprocessing.connection`` with a random authkey). Every call is one message ``(op,
body)`` and one reply ``("ok", result)`` or ``("error", message)`` (:mod:`.rpc`); sync records
travel as the bytes of ``megatron_logra.sync.wire.encode``, or with ``sync.transport=collective``
as their header, the tensor bytes broadcast to every engine rank (:mod:`.collective_sync`).
``rollout.devices`` puts the engine's processes on CUDA devices of their own, ``rollout.cpus`` pins
them to CPU cores (:mod:`.placement`).

Nothing waits forever: the launch has ``rollout.start_timeout_s``, every request
``rollout.request_timeout_s``, and while waiting the client checks that every engine process
is alive. A dead engine, a timeout, a protocol version mismatch or a refused record are errors
that name the cause (and the tail of the engine's log).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

import torch

from megatron_logra.config import Config, RolloutConfig, SyncConfig
from megatron_logra.local_ports import free_port
from megatron_logra.rollout.collective_sync import CollectiveSender, TransportStats, channel_device
from megatron_logra.rollout.engine import EngineResponse
from megatron_logra.rollout.placement import engine_device_env, pin_to_cpus
from megatron_logra.rollout.rpc import (
    LIVENESS_POLL_S,
    EngineError,
    EngineProcesses,
    RpcClient,
    disable_nagle,
)

__all__ = ["ENGINE_PROTOCOL", "EngineError", "MegatronEngine", "engine_config"]

ENGINE_PROTOCOL = "megatron_logra.engine/1"
"""Both ends refuse to talk to another protocol version."""
AUTHKEY_ENV = "MEGATRON_LOGRA_ENGINE_AUTHKEY"
# A closed engine has this long to exit before it is killed.
_EXIT_TIMEOUT_S = 30
_LAUNCHER_VARIABLES = frozenset({"GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME",
                                 "ROLE_WORLD_SIZE", "LOCAL_WORLD_SIZE"})
# The engine runs this installation's package, wherever the trainer was started from.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def engine_config(cfg: Config) -> dict[str, Any]:
    """The engine's own config as a dict: the trainer's model, tokenizer and seeds, its own
    layout (``rollout.tp``, no pipeline, one data-parallel rank; CUDA on ``rollout.devices``),
    sampling in place."""
    # On its own devices (rollout.devices) the engine's world is NCCL, whatever the trainer's.
    device = "cuda" if cfg.rollout.devices else cfg.parallel.device
    parallel = dataclasses.replace(cfg.parallel, tp=cfg.rollout.tp, pp=1, vpp=None, dp=None,
                                   sp=False, device=device)
    # The engine samples in place: no engine of its own to start, place or sync (it learns of
    # the trainer's transport from the open_channel request, and its devices are already its
    # env), so its rollout and sync sections are the colocated defaults.
    rollout, sync = RolloutConfig(), SyncConfig()
    checkpoint = dataclasses.replace(cfg.checkpoint, resume=False)
    data = cfg.to_dict()
    data.update(parallel=dataclasses.asdict(parallel), rollout=dataclasses.asdict(rollout),
                sync=dataclasses.asdict(sync), checkpoint=dataclasses.asdict(checkpoint))
    return data


class MegatronEngine:
    """The client of the Megatron engine server; implements ``GenerationEngine``.

    Args:
        cfg: the trainer's resolved config (``rollout.tp`` and the timeouts are read).
        log_dir: the engine ranks write their output to ``log_dir/engine_rank<r>.log``.
        target_names: the parameters the engine keeps an exact fp32 shadow of (the LoGRA
            targets where low-rank records arrive: the trainer's ``engine_shadow_targets``).
    """

    weight_layout = "megatron"  # the same GPT: the trainer's names and fused layouts

    def __init__(self, cfg: Config, log_dir: str | Path, target_names: Sequence[str] = ()) -> None:
        self.cfg = cfg
        self.log_dir = Path(log_dir)
        self.target_names = sorted(target_names)
        self._procs = EngineProcesses("rollout engine")
        self._rpc: RpcClient | None = None
        self._sender: CollectiveSender | None = None  # sync.transport=collective
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.info: dict[str, Any] = {}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._rpc is not None:
            return
        ro = self.cfg.rollout
        placement = engine_device_env(
            ro.devices, environ=os.environ,
            cuda_device_count=torch.cuda.device_count() if ro.devices else 0)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._tmp = tempfile.TemporaryDirectory(prefix="logra_engine_")
        config_path = Path(self._tmp.name) / "engine_config.json"
        config_path.write_text(json.dumps(engine_config(self.cfg)))
        targets_path = Path(self._tmp.name) / "shadow_targets.json"
        targets_path.write_text(json.dumps(self.target_names))
        # The engine's rank 0 listens on a port of the kernel's choosing and writes it here.
        port_file = Path(self._tmp.name) / "port"
        dist_port, authkey = free_port(), os.urandom(32)
        for rank in range(ro.tp):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": str(ro.tp),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(dist_port),
                   AUTHKEY_ENV: authkey.hex(), **placement}
            for key in list(env):
                # A trainer under torchrun: its agent's variables would make the engine's
                # rank 0 join the trainer's rendezvous store instead of creating its own.
                if key.startswith("TORCHELASTIC_") or key in _LAUNCHER_VARIABLES:
                    del env[key]
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT,
                                                              env.get("PYTHONPATH")]))
            log_path = self.log_dir / f"engine_rank{rank}.log"
            with open(log_path, "w") as log:
                process = subprocess.Popen(
                    [sys.executable, "-m", "megatron_logra.mcore.inference.engine_server",
                     "--config", str(config_path), "--port-file", str(port_file),
                     "--shadow-targets", str(targets_path)],
                    env=env, stdout=log, stderr=subprocess.STDOUT,
                )
                self._procs.add(f"rank {rank}", process, log_path)
            if ro.cpus:
                try:
                    pin_to_cpus(process.pid, [ro.cpus[rank]], f"engine rank {rank}")
                except ValueError:
                    self._shutdown(kill=True)
                    raise
        deadline = time.monotonic() + ro.start_timeout_s
        while self._rpc is None:
            try:
                self._procs.check_alive("starting")
            except EngineError:
                self._shutdown(kill=True)
                raise
            if time.monotonic() > deadline:
                self._shutdown(kill=True)
                raise EngineError(
                    f"the rollout engine did not accept a connection within "
                    f"rollout.start_timeout_s={ro.start_timeout_s} s; raise it or see "
                    f"{self.log_dir}/engine_rank0.log"
                )
            try:
                conn = Client(("127.0.0.1", int(port_file.read_text())), authkey=authkey)
            except (ConnectionRefusedError, FileNotFoundError):
                time.sleep(LIVENESS_POLL_S)
                continue
            disable_nagle(conn)
            self._rpc = RpcClient(self._procs, conn, conn,
                                  timeout_knob="rollout.request_timeout_s")
        merge_device = channel_device(self.cfg.parallel.device).type
        self.info = self._call("hello", {"protocol": ENGINE_PROTOCOL,
                                         "merge_device": merge_device},
                               timeout_s=ro.start_timeout_s)
        if self.info.get("protocol") != ENGINE_PROTOCOL:
            self.close()
            raise EngineError(f"the rollout engine speaks {self.info.get('protocol')!r}, this "
                              f"trainer {ENGINE_PROTOCOL!r}: run both from one installation")
        if self.cfg.sync.transport == "collective":
            self._sender = CollectiveSender(
                self._rpc, engine_ranks=ro.tp, device=channel_device(self.cfg.parallel.device),
                timeout_s=ro.request_timeout_s)
            try:
                self._sender.open(timeout_s=ro.start_timeout_s)
            except EngineError:
                self.close()
                raise

    def close(self) -> None:
        self._shutdown(kill=False)

    def _shutdown(self, *, kill: bool) -> None:
        """Ask the engine to stop (or, once a rank died, kill the rest: they cannot finish)."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._rpc is not None:
            if self._rpc.connected:
                try:
                    self._rpc.send("close", None)  # the engine exits without a reply
                except EngineError:
                    pass
            self._rpc.disconnect()
            self._rpc = None
        self._procs.stop(kill=kill, timeout_s=_EXIT_TIMEOUT_S)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    @property
    def replay_device(self) -> str:
        """The device kind the engine replays low-rank merges on (after ``start``)."""
        return self.info["replay_device"]

    # ------------------------------------------------------------------ the protocol

    def generate(self, prompt_token_ids: list[list[int]], *, max_new_tokens: int,
                 temperature: float, top_p: float, seed: int,
                 stop_token_ids: list[int]) -> list[EngineResponse]:
        result = self._call("generate", {
            "prompts": [list(map(int, p)) for p in prompt_token_ids],
            "max_new_tokens": int(max_new_tokens), "temperature": float(temperature),
            "top_p": float(top_p), "seed": int(seed),
            "stop_token_ids": [int(t) for t in stop_token_ids],
        })
        return [(list(tokens), list(logprobs)) for tokens, logprobs in result]

    def apply_sync(self, payload: bytes) -> None:
        if self._sender is not None:
            self._sender.apply(payload, timeout_s=self.cfg.rollout.request_timeout_s)
        else:
            self._call("sync", bytes(payload))

    @property
    def transport_stats(self) -> TransportStats | None:
        """What the collective transport carried (None with ``sync.transport=rpc``)."""
        return None if self._sender is None else self._sender.stats

    def weight_checksums(self) -> dict[str, str]:
        return dict(self._call("checksums", None))
    # ------------------------------------------------------------------ transport

    def _call(self, op: str, body: Any, *, timeout_s: float | None = None) -> Any:
        if self._rpc is None:
            raise EngineError(f"rollout engine {op}: the engine is not running (call start())")
        timeout_s = self.cfg.rollout.request_timeout_s if timeout_s is None else timeout_s
        return self._rpc.call(op, body, timeout_s=timeout_s)
