"""The vLLM worker extension (``worker_extension_cls``): each vLLM worker keeps an exact shadow
of the policy and writes the weights it serves from it.

The trainer's records address Megatron's full (TP=1) tensors, and the shadow replays each merge
on a block of the trainer's own shape (:class:`megatron_logra.sync.shadow.EngineShadow`: the
trainer's merge function, so the trainer's rounding). Each worker keeps only its own TP shard of
the targets (1/tp of their fp32 bytes; the shadow replays a merge it holds part of at the
trainer's block shape) and writes a changed target shard straight into its vLLM parameter; the
other tensors are kept whole and loaded through vLLM's own ``load_weights``, which cuts this
rank's shard (:mod:`.layout`). vLLM calls these methods through ``collective_rpc``: records
travel as wire bytes (tensor arguments would arrive as lists).
"""

from __future__ import annotations

import io
from typing import Any

import torch

from megatron_logra.sync.replay_device import replay_device
from megatron_logra.sync.shadow import EngineShadow
from megatron_logra.sync.transport import ChannelAddress, TensorChannel, payload_digest
from megatron_logra.sync.wire import decode
from megatron_logra.vllm_plugin.layout import (
    ServedArch,
    hf_tensors,
    target_tp_shard,
    vllm_target_param,
    vllm_target_shard,
)


class LowRankSyncExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner``)."""

    def megatron_logra_init(self, target_names: list[str], merge_device: str) -> tuple[str, str]:
        """Build this worker's shadow; ``(served dtype, the device kind merges replay on)``."""
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        model_config = self.model_runner.model_config
        arch = ServedArch.from_hf_config(model_config.hf_config)
        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        params = dict(self.model_runner.model.named_parameters())
        shards, self._logra_targets = {}, {}
        for name in target_names:
            param = vllm_target_param(name)
            if param not in params:
                raise RuntimeError(f"vLLM's model has no parameter {param} for target {name}")
            shards[name] = target_tp_shard(name, params[param].shape, tp_rank, tp_size, arch)
            self._logra_targets[name] = params[param]
        self._logra_arch, self._logra_tp = arch, tp_size
        own_device = torch.device(getattr(self, "device", None) or "cpu")
        self._logra_shadow = EngineShadow(target_names, served_dtype=model_config.dtype,
                                          shards=shards,
                                          replay_device=replay_device(merge_device, own_device))
        return str(model_config.dtype), self._logra_shadow.replay_device.type

    def megatron_logra_apply(self, payload: bytes) -> tuple[str, list[str] | str]:
        """Apply one wire-encoded record to the shadow and load what changed into the model:
        ``("ok", changed names)`` or ``("error", message)``. A refusal is returned, not raised:
        with TP > 1 a raising worker leaves the other workers' replies queued in vLLM's RPC,
        and the next call would read them."""
        try:
            return "ok", self._apply(payload)
        except (RuntimeError, ValueError) as error:
            return "error", str(error)

    def megatron_logra_open_channel(self, address: dict[str, Any]) -> int:
        """Join the trainer's sync channel (``sync.transport=collective``) as rank 1 + this
        worker's rank."""
        channel_address = ChannelAddress(**address)
        device = (torch.device("cuda", torch.cuda.current_device())
                  if channel_address.backend == "nccl" else torch.device("cpu"))
        self._logra_channel = TensorChannel.open_engine(channel_address, self.rank, device)
        return self._logra_channel.rank

    def megatron_logra_apply_collective(self, header: bytes, nbytes: int
                                        ) -> tuple[str, list[str] | str, str]:
        """``megatron_logra_apply`` of the record whose tensor bytes this worker receives from
        the trainer's broadcast (always received first: the trainer's broadcast must be met),
        and the digest of the record it rebuilt."""
        payload = self._logra_channel.receive_payload(header, nbytes)
        status, value = self.megatron_logra_apply(payload)
        return status, value, payload_digest(payload)

    def _apply(self, payload: bytes) -> list[str]:
        shadow: EngineShadow = self._logra_shadow
        names = shadow.apply(decode(payload))  # raises, changing nothing, on a refused record
        try:
            self._load(names)
        except Exception as error:
            # The shadow took the record, the served model did not: they differ now, so refuse
            # everything until a full sync rebuilds both.
            shadow.invalidate()
            raise RuntimeError(f"loading {names[:4]} into vLLM failed after the shadow took "
                               f"the record ({type(error).__name__}: {error}); the engine "
                               "refuses every record until a full sync") from error
        return names

    def _load(self, names: list[str]) -> None:
        shadow, arch = self._logra_shadow, self._logra_arch
        tensors = [pair for name in names if name not in self._logra_targets
                   for pair in hf_tensors(name, shadow.served[name], arch)]
        with torch.no_grad():
            for name in names:
                if name in self._logra_targets:  # this rank's shard, in vLLM's row order
                    self._logra_targets[name].copy_(
                        vllm_target_shard(name, shadow.served[name], arch, self._logra_tp))
            if tensors:
                self.model_runner.model.load_weights(iter(tensors))

    def megatron_logra_served(self) -> bytes:
        """This rank's parameters as vLLM serves them (safetensors bytes), for the weight check."""
        from safetensors.torch import save

        params = {name: p.detach().contiguous().clone()
                  for name, p in self.model_runner.model.named_parameters()}
        return save(params)

    def megatron_logra_counts(self) -> dict[str, Any]:
        return dict(self._logra_shadow.counts)


def load_served(blob: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(io.BytesIO(blob).getvalue())
