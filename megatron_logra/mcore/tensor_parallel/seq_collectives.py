"""Gather and reduce-scatter along the first (sequence) dimension over the TP group.

What sequence parallelism does to activations, for tensors this package owns (projected inputs
of sketched layers, tangents of the KL probe). Fresh output tensors are allocated: Megatron's
global memory buffer may hold a primal activation that is still in use.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_first_dim(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    out = torch.empty(
        (tensor.shape[0] * world, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )
    dist.all_gather_single(out, tensor.contiguous(), group=group)
    return out


def reduce_scatter_first_dim(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    if tensor.shape[0] % world:
        raise RuntimeError(
            f"cannot reduce-scatter {tuple(tensor.shape)} over {world} ranks along dim 0"
        )
    out = torch.empty(
        (tensor.shape[0] // world, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )
    dist.reduce_scatter_single(out, tensor.contiguous(), group=group)
    return out
