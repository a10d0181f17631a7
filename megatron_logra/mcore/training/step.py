"""One optimizer step of a :class:`TrainingSetup` on given microbatches.

What ``megatron-logra train`` does each step, and what the benchmarks and tests call directly:
zero grads and sketches, Megatron's forward/backward schedule (per-token loss sums;
``finalize_model_grads`` divides by the global token count), ``optimizer.step()`` (which runs
the LoGRA step scale it was built with; its probe batch must be set first), one LR-scheduler
step.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_logra.context_parallel import split_batch
from megatron_logra.data.lm_batches import Microbatch
from megatron_logra.mcore.process_groups import ParallelGroups
from megatron_logra.mcore.training.forward_backward import forward_backward
from megatron_logra.mcore.training.setup import TrainingSetup


@dataclass(frozen=True)
class StepResult:
    loss: float
    """Token-mean loss of the global batch (before the update)."""
    grad_norm: float | None
    """Global gradient norm the optimizer computed (None when it does not compute one)."""


def _loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of per-token losses and the token count (Megatron's per-token-loss convention)."""
    loss_sum = (output_tensor.float() * loss_mask).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm_loss": torch.stack([loss_sum.detach(),
                                                          num_tokens.detach().float()])}


def _forward_step(data_iterator: Iterator[Microbatch], model: torch.nn.Module) -> tuple[Any, Any]:
    batch = next(data_iterator)
    output = model(batch.tokens, batch.position_ids, None, labels=batch.labels)
    return output, functools.partial(_loss_func, batch.loss_mask)


def _global_loss(losses: list[dict[str, torch.Tensor]], groups: ParallelGroups) -> float:
    """Token-mean loss over the global batch. Only last-stage ranks hold losses; summing
    (loss_sum, tokens) over the world counts every TP replica equally, so the ratio is exact."""
    total = torch.zeros(2, dtype=torch.float64, device=groups.device)
    for record in losses:
        total += record["lm_loss"].to(torch.float64)
    dist.all_reduce(total)
    return float(total[0] / total[1])


def train_step(
    setup: TrainingSetup,
    microbatches: Sequence[Microbatch],
    *,
    groups: ParallelGroups,
    seq_length: int,
    micro_batch_size: int,
) -> StepResult:
    """Train on this rank's ``microbatches`` (every data-parallel rank passes its own whole
    sequences; under context parallelism each rank keeps its own chunks of them)."""
    if not microbatches:
        raise ValueError("microbatches is empty; give this rank at least one microbatch")
    microbatches = [split_batch(batch, groups.cp_rank, groups.cp_size) for batch in microbatches]
    for chunk in setup.model_chunks:
        chunk.zero_grad_buffer()
    setup.optimizer.zero_grad()
    losses = forward_backward(setup.model_chunks, microbatches, _forward_step,
                              seq_length=seq_length, micro_batch_size=micro_batch_size)
    success, grad_norm, _ = setup.optimizer.step()
    if not success:
        raise RuntimeError("the optimizer step reported failure (non-finite gradients)")
    setup.scheduler.step(1)
    return StepResult(loss=_global_loss(losses, groups),
                      grad_norm=None if grad_norm is None else float(grad_norm))
