"""Language-modelling batches that do not depend on the parallel layout.

The token stream is cut into non-overlapping windows of ``seq_length + 1`` tokens (inputs and
shifted labels). Step ``k`` trains on global samples ``k*G .. (k+1)*G - 1`` of an endless sequence
of epochs, each a seeded permutation of the windows. Data-parallel rank ``d`` of ``D`` takes the
``d``-th contiguous ``G/D`` of them and splits it into microbatches. The union over ranks and
microbatches is the same global batch for every (dp, micro_batch_size) split, which is what makes
DP=2 and two microbatches comparable with DP=1 and one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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


class LMBatchSchedule:
    def __init__(
        self, tokens: np.ndarray, *, seq_length: int, global_batch_size: int, seed: int
    ) -> None:
        self.tokens = tokens
        self.seq_length = seq_length
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.num_samples = (len(tokens) - 1) // seq_length
        if self.num_samples < global_batch_size:
            raise ValueError(
                f"the corpus has {len(tokens)} tokens = {self.num_samples} samples of "
                f"seq_length {seq_length}, fewer than one global batch of {global_batch_size}; "
                "make a larger dataset or lower train.global_batch_size"
            )
        self._epoch_order: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._epoch_order:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch_order = {epoch: rng.permutation(self.num_samples)}
        return self._epoch_order[epoch]

    def global_batch_indices(self, step: int) -> np.ndarray:
        """Sample indices of step ``step`` (0-based), the same for every layout."""
        flat = np.arange(step * self.global_batch_size, (step + 1) * self.global_batch_size)
        epochs, offsets = np.divmod(flat, self.num_samples)
        return np.array([self._order(int(e))[int(o)] for e, o in zip(epochs, offsets, strict=True)])

    def sample(self, index: int) -> np.ndarray:
        start = int(index) * self.seq_length
        return np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64)

    def microbatches(
        self, step: int, *, dp_rank: int, dp_size: int, micro_batch_size: int,
        device: torch.device | str = "cpu",
    ) -> list[Microbatch]:
        """This data-parallel rank's microbatches of step ``step``, in order."""
        per_rank = self.global_batch_size // dp_size
        if per_rank * dp_size != self.global_batch_size or per_rank % micro_batch_size:
            raise ValueError(
                f"global batch {self.global_batch_size} does not split into dp={dp_size} "
                f"ranks of microbatches of {micro_batch_size}"
            )
        mine = self.global_batch_indices(step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        positions = torch.arange(self.seq_length, dtype=torch.int64, device=device)
        out: list[Microbatch] = []
        for start in range(0, per_rank, micro_batch_size):
            windows = np.stack([self.sample(i) for i in mine[start : start + micro_batch_size]])
            window = torch.from_numpy(windows).to(device)
            out.append(
                Microbatch(
                    tokens=window[:, :-1].contiguous(),
                    labels=window[:, 1:].contiguous(),
                    loss_mask=torch.ones(
                        window.shape[0], self.seq_length, dtype=torch.float32, device=device
                    ),
                    position_ids=positions.expand(window.shape[0], -1).contiguous(),
                )
            )
        return out
