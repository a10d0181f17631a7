"""The row blocks paper mode's weight norm is summed in (torch-free: the memory estimator counts
the same block the optimizer allocates)."""

from __future__ import annotations

NORM_BLOCK_ELEMENTS = 1 << 22
"""Elements per block of :func:`megatron_logra.row_adam_paper.blockwise_sq_norm`: its float64
temporary is 32 MiB at most, instead of a float64 copy of the largest target weight and its
square (the 7B preset's owned fc1 rows: 0.25 GiB each)."""


def norm_block_rows(width: int) -> int:
    """Rows of a ``width``-wide weight per :data:`NORM_BLOCK_ELEMENTS` block (at least one)."""
    return max(1, NORM_BLOCK_ELEMENTS // width)
