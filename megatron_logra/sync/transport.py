"""The collective transport of sync records (``sync.transport=collective``): a process group of
the trainer's rank 0 and every engine rank, over which each record's tensor bytes are broadcast.

With ``sync.transport=rpc`` (the default) a record's ``wire.encode`` bytes travel whole over the
engine's control channel, and a multi-rank engine re-sends them from its rank 0 (the Megatron
engine's world broadcast, vLLM's ``collective_rpc`` arguments). With ``collective`` the record
is split where ``wire.encode`` puts the tensor bytes behind its JSON header
(:func:`split_payload`): the header still goes over the control channel (a few hundred bytes),
and the tensor bytes are broadcast from the trainer to all engine ranks at once, so every engine
rank receives them directly. Each engine rank joins them back (:func:`join_payload`) into the
very bytes the trainer encoded, decodes and applies them as before (``EngineShadow``, its
refusals unchanged), and answers with :func:`payload_digest` of what it applied, which the
trainer compares with its own: a transport that garbled a byte is an error, not drift.

The group is its own: a ``TCPStore`` the trainer hosts on a free port, and torch's
``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (CUDA) built on it directly -- not the
trainer's default group and not the engine's world, which neither side may block. The backend
is chosen once, from the trainer's device, and travels in the :class:`ChannelAddress`. Every
wait has the group's timeout (``rollout.request_timeout_s``): a dead peer or a missed broadcast
is an error naming the channel, never a hang.

Torch and the standard library only: vLLM's workers load this in their own venv.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_HEADER_LENGTH = struct.Struct("<Q")  # wire.encode's: an 8-byte length, then the JSON header
BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl"}
"""The channel's backend, by the trainer's device type."""
# The first broadcast on a new channel: proves every member joined before a record relies on it.
_HANDSHAKE = torch.tensor(list(b"logra-x1"), dtype=torch.uint8)


def split_payload(payload: bytes) -> tuple[bytes, memoryview]:
    """``(header, tensor bytes)`` of a ``wire.encode`` record: the length prefix and JSON header
    (the control channel's part), then the raw tensor bytes (the broadcast's)."""
    (length,) = _HEADER_LENGTH.unpack_from(payload)
    cut = _HEADER_LENGTH.size + length
    return bytes(payload[:cut]), memoryview(payload)[cut:]


def join_payload(header: bytes, tensor_bytes: bytes) -> bytes:
    """The record :func:`split_payload` split, byte for byte."""
    (length,) = _HEADER_LENGTH.unpack_from(header)
    if len(header) != _HEADER_LENGTH.size + length:
        raise ValueError(f"a sync header of {len(header)} bytes announces {length} + "
                         f"{_HEADER_LENGTH.size}: not a header split by split_payload")
    return header + bytes(tensor_bytes)


def payload_digest(payload: bytes) -> str:
    """What both ends compare after a collective record: BLAKE2b of the whole record."""
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


@dataclass(frozen=True)
class ChannelAddress:
    """Where and how the channel's members meet (plain values: they cross venvs).

    ``world_size`` is 1 (the trainer, rank 0) + the engine's ranks; engine rank ``r`` is channel
    rank ``1 + r``."""

    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def host_channel(*, engine_ranks: int, device: torch.device, timeout_s: float,
                 host: str = "127.0.0.1") -> tuple[ChannelAddress, dist.TCPStore]:
    """The trainer's first step: its store on a free port and the address the engine joins."""
    backend = BACKENDS.get(device.type)
    if backend is None:
        raise ValueError(f"sync.transport=collective has no backend for device {device}; it "
                         f"supports {sorted(BACKENDS)}")
    store = dist.TCPStore(host, 0, 1 + engine_ranks, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return ChannelAddress(host, store.port, 1 + engine_ranks, backend, float(timeout_s)), store


class TensorChannel:
    """One member's end of the channel: the trainer sends, every engine rank receives."""

    def __init__(self, address: ChannelAddress, rank: int, store: dist.Store,
                 device: torch.device) -> None:
        if address.backend not in BACKENDS.values():
            raise ValueError(f"channel backend {address.backend!r} is not one of "
                             f"{sorted(BACKENDS.values())}")
        if (address.backend == "nccl") != (device.type == "cuda"):
            raise RuntimeError(
                f"the sync channel uses {address.backend} (the trainer's device) but this end's "
                f"device is {device}: a {address.backend} channel needs "
                f"{'CUDA' if address.backend == 'nccl' else 'CPU'} tensors on every member")
        self.address, self.rank, self.device = address, rank, device
        self._store = store  # the trainer's end hosts it: it must live as long as the group
        timeout = datetime.timedelta(seconds=address.timeout_s)
        if address.backend == "gloo":
            self._group = dist.ProcessGroupGloo(store, rank, address.world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(store, rank, address.world_size, options)
        self._timeout = timeout

    # ------------------------------------------------------------------ opening

    @classmethod
    def open_trainer(cls, address: ChannelAddress, store: dist.Store,
                     device: torch.device) -> TensorChannel:
        """The trainer's side, once the engine was asked to join (``host_channel`` first)."""
        channel = cls(address, 0, store, device)
        channel._broadcast(_HANDSHAKE.clone().to(device), "send the handshake")
        return channel

    @classmethod
    def open_engine(cls, address: ChannelAddress, engine_rank: int,
                    device: torch.device) -> TensorChannel:
        """An engine rank's side: connect to the trainer's store and join the group."""
        store = dist.TCPStore(address.host, address.port, address.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=address.timeout_s))
        channel = cls(address, 1 + engine_rank, store, device)
        # The group is connected (and both ends speak it) before the first record depends on it.
        got = torch.empty_like(_HANDSHAKE, device=device)
        channel._broadcast(got, "receive the handshake")
        if not torch.equal(got.cpu(), _HANDSHAKE):
            raise RuntimeError(f"the sync channel's handshake arrived as {got.tolist()}")
        return channel

    # ------------------------------------------------------------------ records

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        if self._group is None:
            raise RuntimeError(f"sync channel rank {self.rank}: {what} after close()")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.timeout = self._timeout
        try:
            self._group.broadcast([tensor], options).wait(self._timeout)
        except RuntimeError as error:
            raise RuntimeError(
                f"sync channel ({self.address.backend}, {self.address.host}:{self.address.port}, "
                f"rank {self.rank} of {self.address.world_size}, timeout "
                f"{self.address.timeout_s:g} s) failed to {what} {tensor.numel()} bytes: "
                f"{error}") from error

    def send(self, tensor_bytes: bytes | memoryview) -> None:
        """The trainer: broadcast one record's tensor bytes to every engine rank."""
        if self.rank != 0:
            raise RuntimeError("only the trainer (channel rank 0) sends on the sync channel")
        if not len(tensor_bytes):
            return  # a record without tensors: nothing to broadcast (the engine skips it too)
        tensor = torch.frombuffer(bytearray(tensor_bytes), dtype=torch.uint8)
        self._broadcast(tensor.to(self.device), "send")

    def receive(self, nbytes: int) -> bytes:
        """An engine rank: the tensor bytes of the record whose header announced ``nbytes``."""
        if not nbytes:
            return b""
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._broadcast(tensor, "receive")
        return tensor.cpu().numpy().tobytes()

    def close(self) -> None:
        """Drop the group now. A gloo group left to the interpreter's teardown can abort the
        process ("terminate called without an active exception": its threads outlive the
        objects they use), which a departing engine rank would report as a crash."""
        self._group = None
        self._store = None

    def receive_payload(self, header: bytes, nbytes: int) -> bytes:
        """An engine rank: the whole record (always receives first: the trainer's broadcast
        must be met even if the header is then refused)."""
        return join_payload(header, self.receive(nbytes))
