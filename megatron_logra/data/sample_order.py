"""Which samples a training step uses, independent of the parallel layout.

Step ``k`` uses global samples ``k*G .. (k+1)*G - 1`` of an endless sequence of epochs, each a
seeded permutation of the ``N`` samples. Data-parallel rank ``d`` of ``D`` takes the ``d``-th
contiguous ``G/D`` of them, which it splits into microbatches in order. The union over ranks and
microbatches is the same global batch for every (dp, micro_batch_size) split: DP=2 with two
microbatches sees exactly what DP=1 with one does.
"""

from __future__ import annotations

import numpy as np


class SampleOrder:
    def __init__(
        self, num_samples: int, *, global_batch_size: int, seed: int, stream: tuple[int, ...] = ()
    ) -> None:
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        # The permutations are drawn from (seed, *stream, epoch): a consumer with its own stream
        # (the RL prompt order) does not walk the data in the supervised order.
        self.seed_key = (seed, *stream)
        self._epoch_order: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        # One epoch cached: consecutive steps almost always fall in the same one.
        if epoch not in self._epoch_order:
            rng = np.random.default_rng([*self.seed_key, epoch])
            self._epoch_order = {epoch: rng.permutation(self.num_samples)}
        return self._epoch_order[epoch]

    def global_batch_indices(self, step: int) -> np.ndarray:
        """Sample indices of step ``step`` (0-based), the same for every layout."""
        flat = np.arange(step * self.global_batch_size, (step + 1) * self.global_batch_size)
        epochs, offsets = np.divmod(flat, self.num_samples)
        return np.array([self._order(int(e))[int(o)] for e, o in zip(epochs, offsets, strict=True)])

    def rank_indices(
        self, step: int, *, dp_rank: int, dp_size: int, micro_batch_size: int
    ) -> np.ndarray:
        """This data-parallel rank's share of step ``step``; its microbatches are consecutive
        runs of ``micro_batch_size``."""
        per_rank = self.global_batch_size // dp_size
        if per_rank * dp_size != self.global_batch_size or per_rank % micro_batch_size:
            raise ValueError(
                f"global batch {self.global_batch_size} does not split into dp={dp_size} "
                f"ranks of microbatches of {micro_batch_size}"
            )
        return self.global_batch_indices(step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
