"""Process groups: start torch.distributed and Megatron's model parallelism for a run.

Everything below this module receives the groups it needs explicitly (a :class:`ParallelGroups`),
so the only reads of Megatron's global ``parallel_state`` are here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_logra.config import Config
from megatron_logra.local_ports import free_port

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelGroups:
    """The groups and coordinates of this rank in the (tp, cp, pp, dp) layout.

    Attributes:
        tp: tensor-parallel group (row-parallel sketches are partial sums over it).
        dp: data-parallel group *with* context parallelism (DP x CP ranks), over which Megatron
            reduces gradients and we reduce sketches and shard masters; ``dp_rank`` and
            ``dp_size`` are its coordinates. Which sequences a rank trains on is ``data_rank``
            of ``data_size`` (the CP ranks of one replica hold the same sequences).
        tp_dp: tensor-and-data-parallel group (one collective for TP partials and the DP sum).
        mp: model-parallel group (tp x pp): gradient statistics of replicated-over-DP tensors.
        pp: pipeline group.
    """

    tp: dist.ProcessGroup
    dp: dist.ProcessGroup
    tp_dp: dist.ProcessGroup
    mp: dist.ProcessGroup
    pp: dist.ProcessGroup
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    pp_rank: int
    pp_size: int
    vpp_size: int
    """Model chunks (virtual pipeline stages) per rank; 1 without interleaving."""
    world_rank: int
    world_size: int
    device: torch.device
    # Expert parallelism (MoE): experts are split over ``ep`` ranks carved out of the DP ones;
    # an expert's copies are reduced over the expert-data-parallel group (dp / ep ranks). With
    # ep=1 (and for dense models) these are the dense groups.
    ep_rank: int = 0
    ep_size: int = 1
    expert_dp_rank: int = 0
    ep: dist.ProcessGroup | None = None
    """Expert-parallel group: the ranks that split one MoE layer's experts."""
    expert_dp: dist.ProcessGroup | None = None
    """Expert-data-parallel group: the ranks holding the same experts (sketches sum over it)."""
    expert_mp: dist.ProcessGroup | None = None
    """Expert tensor x expert x pipeline parallel: every expert shard once (statistics)."""
    # Context parallelism: each sequence split over ``cp_size`` ranks (2 * cp_size chunks).
    cp: dist.ProcessGroup | None = None
    cp_rank: int = 0
    cp_size: int = 1
    data_rank: int = 0
    """Data-parallel rank without CP: which share of the global batch's sequences this rank
    holds (``dp_rank`` when cp = 1; the CP ranks of one replica hold the same sequences)."""
    data_size: int = 1
    """Data-parallel replicas, ``parallel.dp`` (``dp_size`` when cp = 1)."""

    @property
    def expert_dp_size(self) -> int:
        """Ranks holding the same experts (the dense DP size without experts)."""
        if self.expert_dp is None:
            return self.dp_size
        return dist.get_world_size(self.expert_dp)

    def is_first_stage(self, chunk: int = 0) -> bool:
        """Whether model chunk ``chunk`` of this rank holds the first layers (the embedding)."""
        return self.pp_rank == 0 and chunk == 0

    def is_last_stage(self, chunk: int | None = None) -> bool:
        """Whether chunk ``chunk`` (default: this rank's last) holds the output layer."""
        chunk = self.vpp_size - 1 if chunk is None else chunk
        return self.pp_rank == self.pp_size - 1 and chunk == self.vpp_size - 1


def resolve_device(requested: str) -> torch.device:
    """``auto`` becomes cuda when a GPU is visible, else cpu."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("parallel.device=cuda but no GPU is visible; use parallel.device=cpu")
    return torch.device(requested)


def world_size_from_env() -> int:
    """The world size torchrun announces (1 for a plain ``python`` launch)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_parallel(cfg: Config) -> ParallelGroups:
    """Start torch.distributed (torchrun's env:// or a 1-process world) and Megatron's groups.

    ``cfg`` must be resolved (``parallel.dp`` known). On CPU this enables the compatibility
    layer and uses gloo; on GPU, NCCL with one device per local rank.
    """
    device = resolve_device(cfg.parallel.device)
    if device.type == "cpu":
        from megatron_logra.mcore.compat.cpu import enable_cpu_compat

        enable_cpu_compat()
        backend = "gloo"
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"

    collective_timeout = timedelta(seconds=cfg.parallel.collective_timeout_s)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            # A plain `python -m megatron_logra ...`: a world of one process.
            os.environ.update(
                {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
            )
        dist.init_process_group(backend=backend, timeout=collective_timeout)

    world_size = dist.get_world_size()
    p = cfg.parallel
    if p.dp is None or p.tp * p.cp * p.pp * p.dp != world_size:
        raise RuntimeError(
            f"config layout tp={p.tp} cp={p.cp} pp={p.pp} dp={p.dp} does not match world size "
            f"{world_size}"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        context_parallel_size=p.cp,
        pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp,
        expert_model_parallel_size=p.ep,
        # Megatron gives its subgroups their own timeout (30 min by default): the same one.
        distributed_timeout_minutes=cfg.parallel.collective_timeout_s / 60,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)
    groups = ParallelGroups(
        tp=parallel_state.get_tensor_model_parallel_group(),
        dp=parallel_state.get_data_parallel_group(with_context_parallel=True),
        tp_dp=parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True),
        mp=parallel_state.get_model_parallel_group(),
        pp=parallel_state.get_pipeline_model_parallel_group(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(with_context_parallel=True),
        dp_size=parallel_state.get_data_parallel_world_size(with_context_parallel=True),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        vpp_size=p.vpp or 1,
        world_rank=dist.get_rank(),
        world_size=world_size,
        device=device,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_dp_rank=parallel_state.get_expert_data_parallel_rank(),
        ep=parallel_state.get_expert_model_parallel_group(),
        expert_dp=parallel_state.get_expert_data_parallel_group(),
        expert_mp=parallel_state.get_expert_tensor_model_pipeline_parallel_group(),
        cp=parallel_state.get_context_parallel_group(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        cp_size=parallel_state.get_context_parallel_world_size(),
        data_rank=parallel_state.get_data_parallel_rank(),
        data_size=parallel_state.get_data_parallel_world_size(),
    )
    logger.info(
        "rank %d: tp %d/%d cp %d/%d dp %d/%d pp %d/%d on %s (%s)", groups.world_rank,
        groups.tp_rank, groups.tp_size, groups.cp_rank, groups.cp_size, groups.data_rank,
        groups.data_size, groups.pp_rank, groups.pp_size, device, backend,
    )
    return groups


def destroy_parallel() -> None:
    """Tear down Megatron's groups and the process group (end of a run or a test)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
