"""Layout-independent names and shapes of Megatron parameters.

A parameter of a TP/PP-sharded Megatron model is identified here by its *global name* (the
TP=1, PP=1 name: decoder layers numbered globally) and its *full* tensor (the TP=1 tensor). A
shard is recovered from the full tensor exactly as Megatron's CPU initialisation slices its
master weight, including ``partition_stride`` (the gated fc1 stores interleaved [gate, up]
blocks per rank). Initialisation and weight comparison across layouts both rest on this.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_logra.mcore.models.moe import expert_offsets, global_expert_name

_LAYER_PREFIX = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers (``.module`` chains)."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def global_named_parameters(
    model_chunk: torch.nn.Module,
) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(global name, parameter)`` for every parameter of one model chunk.

    Local decoder-layer indices are replaced by the global layer number (Megatron's
    ``TransformerLayer.layer_number`` is 1-based and global), local expert indices by global
    ones (:mod:`megatron_logra.mcore.models.moe`), wrappers are stripped.
    """
    model = unwrap_model(model_chunk)
    offsets = expert_offsets(model)
    local_to_global: dict[int, int] = {}
    decoder = getattr(model, "decoder", None)
    if decoder is not None:
        for local_index, layer in enumerate(decoder.layers):
            if not isinstance(layer, TransformerLayer):
                raise TypeError(f"unexpected decoder layer type {type(layer).__name__}")
            local_to_global[local_index] = layer.layer_number - 1
    for name, param in model.named_parameters():
        name = global_expert_name(name, offsets)
        match = _LAYER_PREFIX.match(name)
        if match:
            head, index, tail = match.groups()
            name = f"{head}{local_to_global[int(index)]}{tail}"
        yield name, param


def partition_of(param: torch.Tensor) -> tuple[int | None, int]:
    """``(partition_dim, stride)`` of a tensor-parallel parameter, ``(None, 1)`` otherwise."""
    if getattr(param, "tensor_model_parallel", False):
        return int(param.partition_dim), int(getattr(param, "partition_stride", 1))
    return None, 1


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    dim, _ = partition_of(param)
    shape = list(param.shape)
    if dim is not None:
        shape[dim] *= tp_size
    return tuple(shape)


def shard_from_full(
    full: torch.Tensor, dim: int | None, stride: int, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This rank's shard of ``full``, sliced as Megatron slices a master weight."""
    if dim is None or tp_size == 1:
        return full
    per_partition = full.shape[dim] // tp_size
    if per_partition * tp_size != full.shape[dim] or per_partition % stride:
        raise ValueError(
            f"dimension {dim} of size {full.shape[dim]} does not split into {tp_size} shards "
            f"with stride {stride}"
        )
    chunks = torch.split(full, per_partition // stride, dim=dim)
    return torch.cat(chunks[tp_rank::tp_size], dim=dim)


def full_from_shards(
    shards: list[torch.Tensor], dim: int | None, stride: int
) -> torch.Tensor:
    """Inverse of :func:`shard_from_full` given every rank's shard in TP-rank order."""
    if dim is None or len(shards) == 1:
        return shards[0]
    tp_size = len(shards)
    pieces = [torch.split(shard, shard.shape[dim] // stride, dim=dim) for shard in shards]
    ordered = [pieces[rank][block] for block in range(stride) for rank in range(tp_size)]
    return torch.cat(ordered, dim=dim)


def gather_full(param: torch.Tensor, tp_group: dist.ProcessGroup, tp_size: int) -> torch.Tensor:
    """All-gather a parameter's TP shards into the full tensor (on every TP rank)."""
    dim, stride = partition_of(param)
    if dim is None or tp_size == 1:
        return param.detach().clone()
    shards = [torch.empty_like(param) for _ in range(tp_size)]
    dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
    return full_from_shards(shards, dim, stride)
