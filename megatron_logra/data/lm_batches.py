"""Language-modelling batches that do not depend on the parallel layout.

The token stream is cut into non-overlapping windows of ``seq_length + 1`` tokens (inputs and
shifted labels); which windows a step and a data-parallel rank use is :class:`SampleOrder`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_logra.data.sample_order import SampleOrder
from megatron_logra.packing.rows import RowLayout


@dataclass(frozen=True)
class Microbatch:
    tokens: torch.Tensor
    """[micro_batch_size, seq_length] int64 inputs."""
    labels: torch.Tensor
    """[micro_batch_size, seq_length] int64 next tokens."""
    loss_mask: torch.Tensor
    """[micro_batch_size, seq_length] float32, 1 where the label counts."""
    position_ids: torch.Tensor
    """[micro_batch_size, seq_length] int64."""
    layout: RowLayout | None = None
    """A packed microbatch (train.packing): the tensors are one ``[1, T]`` row of several
    sequences laid out as this says (megatron_logra.data.packed_batches). None: unpacked."""


class BatchSchedule:
    """Layout-independent batches: a step's samples and a data-parallel rank's share are
    :class:`SampleOrder`'s; a subclass says what the token windows and loss masks of given
    samples are."""

    seq_length: int
    order: SampleOrder

    def global_batch_indices(self, step: int) -> np.ndarray:
        return self.order.global_batch_indices(step)

    def windows(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, seq_length + 1]`` int64 token windows of samples ``indices`` and their
        ``[n, seq_length]`` float32 loss masks (label position t predicts token t + 1)."""
        raise NotImplementedError

    def microbatches(
        self, step: int, *, dp_rank: int, dp_size: int, micro_batch_size: int,
        device: torch.device | str = "cpu",
    ) -> list[Microbatch]:
        """This data-parallel rank's microbatches of step ``step``, in order."""
        mine = self.order.rank_indices(step, dp_rank=dp_rank, dp_size=dp_size,
                                       micro_batch_size=micro_batch_size)
        positions = torch.arange(self.seq_length, dtype=torch.int64, device=device)
        out: list[Microbatch] = []
        for start in range(0, len(mine), micro_batch_size):
            window, mask = self.windows(mine[start : start + micro_batch_size])
            window, mask = window.to(device), mask.to(device)
            out.append(
                Microbatch(
                    tokens=window[:, :-1].contiguous(),
                    labels=window[:, 1:].contiguous(),
                    loss_mask=mask,
                    position_ids=positions.expand(window.shape[0], -1).contiguous(),
                )
            )
        return out


class LMBatchSchedule(BatchSchedule):
    def __init__(
        self, tokens: np.ndarray, *, seq_length: int, global_batch_size: int, seed: int
    ) -> None:
        self.tokens = tokens
        self.seq_length = seq_length
        self.num_samples = (len(tokens) - 1) // seq_length
        if self.num_samples < global_batch_size:
            raise ValueError(
                f"the corpus has {len(tokens)} tokens = {self.num_samples} samples of "
                f"seq_length {seq_length}, fewer than one global batch of {global_batch_size}; "
                "make a larger dataset or lower train.global_batch_size"
            )
        self.order = SampleOrder(self.num_samples, global_batch_size=global_batch_size, seed=seed)

    def sample(self, index: int) -> np.ndarray:
        start = int(index) * self.seq_length
        return np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64)

    def windows(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.from_numpy(np.stack([self.sample(i) for i in indices]))
        return window, torch.ones(window.shape[0], self.seq_length, dtype=torch.float32)
