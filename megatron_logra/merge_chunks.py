"""The chunks of the ``host`` master store's merge: whole groups of rows, at most a budget.

The host store streams its fp32 master rows through the device in chunks of at most
``logra.merge_chunk_mib``; a chunk holds a whole number of :data:`MERGE_ROW_ALIGNMENT`-row
groups (the most that fit), and a budget below one group of a target's width is refused, never
rounded up. Torch-free: the config checks the budget against the model before any rank starts.
"""

from __future__ import annotations

MIB = 1 << 20
MERGE_ROW_ALIGNMENT = 192
"""Host chunks hold a multiple of this many rows. A CPU GEMM computes rows in register blocks
(4, 6, 8, 12, 16, 32 or 64 rows, by kernel) and a block's leftover rows with another kernel,
which rounds differently: on an AVX-512 CPU, chunks of 3 or 5 rows differed from the one-call
merge in 1-9% of elements, chunks of any multiple of 4 rows in none (docs/LOG.md 2026-12-02).
192 is a multiple of every one of those blocks, so a chunked merge meets the leftover rows
exactly where the one-call merge of the same block does."""


def host_chunk_rows(chunk_bytes: int, width: int) -> int:
    """Rows of a host merge chunk of at most ``chunk_bytes`` fp32 bytes ``width`` columns
    wide: the most whole groups of MERGE_ROW_ALIGNMENT rows that fit (0: not one group)."""
    return chunk_bytes // (4 * width * MERGE_ROW_ALIGNMENT) * MERGE_ROW_ALIGNMENT


def min_host_chunk_mib(width: int) -> float:
    """The smallest ``logra.merge_chunk_mib`` that holds one row group ``width`` columns wide."""
    return 4 * width * MERGE_ROW_ALIGNMENT / MIB
