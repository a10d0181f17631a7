"""Supervised batches packed into token-budget rows (``sft`` / ``train`` on prompt data with
train.packing).

A step's global batch is the same as unpacked (:class:`~megatron_logra.data.sample_order
.SampleOrder`); each sample's window is cut after its last counted label -- what follows is
padding, or tokens no label depends on (causal attention) -- and the samples are packed whole
into rows by :func:`megatron_logra.packing.plan_packs`, balanced over the data-parallel ranks.
The loss is the unpacked one token for token: every rank sums its rows' per-token losses and
Megatron divides once by the global count of counted labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_logra.data.lm_batches import BatchSchedule, Microbatch
from megatron_logra.packing import PackPlan, RowLayout, pack_row, plan_packs


@dataclass(frozen=True)
class PackedStep:
    """This rank's packed microbatches of a step and the plan of the whole step."""

    microbatches: list[Microbatch]
    plan: PackPlan


def labelled_lengths(loss_mask: torch.Tensor) -> list[int]:
    """Per row of a ``[n, s]`` loss mask: the positions up to its last counted label (a sample
    with no counted label keeps one position)."""
    positions = torch.arange(1, loss_mask.shape[1] + 1)
    return [max(int((positions * (row > 0)).max()), 1) for row in loss_mask.cpu()]


def packed_step(
    schedule: BatchSchedule, step: int, *, max_tokens: int, algorithm: str, dp_rank: int,
    dp_size: int, sequence_multiple: int = 1, row_multiple: int = 1,
    microbatch_multiple: int = 1, uniform_rows: bool = False,
    device: torch.device | str = "cpu",
) -> PackedStep:
    """Step ``step``'s global batch packed into rows of at most ``max_tokens``; this rank's."""
    indices = schedule.global_batch_indices(step)
    window, mask = schedule.windows(np.asarray(indices))
    lengths = labelled_lengths(mask)
    plan = plan_packs(lengths, max_tokens=max_tokens, dp_size=dp_size, algorithm=algorithm,
                      sequence_multiple=sequence_multiple, row_multiple=row_multiple,
                      microbatch_multiple=microbatch_multiple,
                      uniform_rows=uniform_rows)
    microbatches = [_row(pack.indices, lengths, window, mask, RowLayout.of(pack), device)
                    for pack in plan.ranks[dp_rank]]
    return PackedStep(microbatches=microbatches, plan=plan)


def _row(indices: Sequence[int], lengths: Sequence[int], window: torch.Tensor,
         mask: torch.Tensor, layout: RowLayout, device: torch.device | str) -> Microbatch:
    def row(values: torch.Tensor, fill: float | int) -> torch.Tensor:
        return pack_row([values[i, :lengths[i]] for i in indices], layout, fill,
                        dtype=values.dtype).to(device)

    tokens, labels = window[:, :-1], window[:, 1:]
    return Microbatch(tokens=row(tokens, 0), labels=row(labels, 0), loss_mask=row(mask, 0.0),
                      position_ids=layout.position_ids().to(device), layout=layout)
