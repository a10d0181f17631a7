"""fp32 master rows of a bf16 weight, sharded over data parallelism by whole rows.

A LoGRA step changes a weight by ~1e-4 of its size; bf16 resolves ~4e-3 relative, so merging the
update into bf16 weights directly rounds almost all of it away, silently, every step. The update
therefore goes into an fp32 master and the bf16 weight is re-derived from it.

Each data-parallel rank keeps masters only for the rows it owns (:class:`RowShard`): the step's
reduced sketch rows arrive by reduce-scatter, the rank updates its master rows, casts them and
all-gathers the bf16 rows so that every replica holds the same weight again -- Megatron's
distributed optimizer, done by rows. Per target parameter that is 2 + 4/dp bytes, against 6 +
12/dp for the distributed Adam.

Shape suffixes: O = owned rows, I = local input columns, R = sketch rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_logra.row_sharding import RowShard
from megatron_logra.sketch import apply_low_rank_update_


class RowShardedMaster:
    """The fp32 master rows this DP rank owns of one (bf16) weight."""

    def __init__(self, weight: torch.Tensor, shard: RowShard) -> None:
        if weight.shape[0] != shard.rows:
            raise ValueError(f"weight has {weight.shape[0]} rows, the shard plan {shard.rows}")
        self.shard = shard
        self.master_OI = torch.cat(
            [weight.detach()[lo:hi].float() for lo, hi in shard.ranges()], dim=0
        )

    @property
    def nbytes(self) -> int:
        return self.master_OI.numel() * self.master_OI.element_size()

    def apply_update_(
        self, direction_OR: torch.Tensor, proj_RI: torch.Tensor, *, lr: float, weight_decay: float
    ) -> None:
        """``M <- (1 - lr wd) M - lr D A`` on the owned rows (D: this rank's owned rows)."""
        apply_low_rank_update_(
            self.master_OI, direction_OR, proj_RI, lr=lr, weight_decay=weight_decay
        )

    @torch.no_grad()
    def publish_(self, weight: torch.Tensor, dp_group: dist.ProcessGroup | None) -> int:
        """Write every rank's updated rows into ``weight`` on every rank; returns collectives.

        One all-gather per stride block: block ``b`` of the weight is ``[dp * c, n]``
        contiguous rows, and DP rank ``d`` contributes its ``c`` rows of it.
        """
        shard, chunk = self.shard, self.shard.chunk_rows
        blocks = weight.data.view(shard.stride, shard.block_rows, weight.shape[1])
        collectives = 0
        for block in range(shard.stride):
            mine = self.master_OI[block * chunk : (block + 1) * chunk].to(weight.dtype)
            if shard.dp_size == 1:
                blocks[block].copy_(mine)
            else:
                dist.all_gather_single(blocks[block], mine, group=dp_group)
                collectives += 1
        return collectives

    def load_(self, master_OI: torch.Tensor) -> None:
        if master_OI.shape != self.master_OI.shape:
            raise RuntimeError(
                f"master shape {tuple(master_OI.shape)} does not match {tuple(self.master_OI.shape)}"
            )
        self.master_OI.copy_(master_OI)
