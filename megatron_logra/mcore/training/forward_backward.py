"""The one call into Megatron's forward/backward schedules.

Training steps, RL policy updates and forward-only log-prob passes all run their microbatches
through ``get_forward_backward_func()``, which picks no-pipelining, 1F1B or the interleaved
schedule from the layout. Every model chunk (virtual stage) walks the same microbatches in the
schedule's order, so each gets its own iterator over them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func


def forward_backward(
    model_chunks: Sequence[torch.nn.Module],
    microbatches: Sequence[Any],
    forward_step_func: Callable[..., Any],
    *,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
) -> list[Any]:
    """Run ``forward_step_func`` over ``microbatches`` through Megatron's schedule; returns what
    the schedule returns (on the last pipeline stage: one entry per microbatch)."""
    if not microbatches:
        raise ValueError("microbatches is empty; give this rank at least one microbatch")
    iterators = [iter(microbatches) for _ in model_chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=list(model_chunks),
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
    )
