"""The trainer's end of ``sync.transport=collective`` for either engine client
(:mod:`megatron_logra.sync.transport` describes the channel).

Both engine servers answer the same two requests, bodies of plain values:

* ``open_channel {"address": ChannelAddress.to_dict()}``: every engine rank joins the channel
  (engine rank ``r`` as channel rank ``1 + r``) while the trainer joins as rank 0;
* ``sync_collective {"header": bytes, "nbytes": int}``: every engine rank receives the record's
  tensor bytes from the channel's broadcast, joins them to the header, applies the record as
  ``apply_sync`` would and answers ``{"digest": payload_digest(record), ...}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_logra.rollout.rpc import EngineError, RpcClient
from megatron_logra.sync.transport import (
    TensorChannel,
    host_channel,
    payload_digest,
    split_payload,
)


def channel_device(parallel_device: str) -> torch.device:
    """The trainer's tensors on the channel (``parallel.device``: cpu, cuda or auto): its
    current CUDA device, or the CPU."""
    device_type = parallel_device
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


@dataclass
class TransportStats:
    """What travelled how: ``header_bytes`` over the control channel, ``tensor_bytes`` over
    the broadcast (their sum is the records' ``wire.encode`` bytes)."""

    records: int = 0
    header_bytes: int = 0
    tensor_bytes: int = 0


class CollectiveSender:
    """Opens the channel with the engine behind ``rpc`` and ships records over it.

    Args:
        rpc: the engine client's control channel.
        engine_ranks: how many engine processes receive (Megatron engine ranks, vLLM workers).
        device: the trainer's channel device (``channel_device``): decides gloo or NCCL.
        timeout_s: the group's timeout for every wait (``rollout.request_timeout_s``).
    """

    def __init__(self, rpc: RpcClient, *, engine_ranks: int, device: torch.device,
                 timeout_s: float) -> None:
        self._rpc = rpc
        self.engine_ranks = engine_ranks
        self.device = device
        self.timeout_s = timeout_s
        self._channel: TensorChannel | None = None
        self.stats = TransportStats()

    def open(self, *, timeout_s: float) -> None:
        address, store = host_channel(engine_ranks=self.engine_ranks, device=self.device,
                                      timeout_s=self.timeout_s)
        opened: list[TensorChannel] = []

        def join() -> None:
            opened.append(TensorChannel.open_trainer(address, store, self.device))

        self._rpc.call("open_channel", {"address": address.to_dict()}, timeout_s=timeout_s,
                       while_waiting=join)
        self._channel = opened[0]

    def apply(self, payload: bytes, *, timeout_s: float) -> dict[str, Any]:
        """Ship one ``wire.encode`` record; the engine's reply (its digest checked)."""
        if self._channel is None:
            raise EngineError("sync.transport=collective: the channel is not open (start())")
        header, tensor_bytes = split_payload(payload)
        channel = self._channel
        reply = self._rpc.call("sync_collective", {"header": header, "nbytes": len(tensor_bytes)},
                               timeout_s=timeout_s,
                               while_waiting=lambda: channel.send(tensor_bytes))
        expected = payload_digest(payload)
        if reply.get("digest") != expected:
            raise EngineError(
                f"sync.transport=collective: the engine applied a record whose digest is "
                f"{reply.get('digest')}, the trainer sent {expected}: the channel garbled it; "
                "use sync.transport=rpc and report this")
        self.stats.records += 1
        self.stats.header_bytes += len(header)
        self.stats.tensor_bytes += len(tensor_bytes)
        return reply

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()  # the group and the trainer's store go with it
        self._channel = None
