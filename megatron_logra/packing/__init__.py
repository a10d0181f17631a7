"""Sequence packing: a step's sequences in token-budget rows, balanced over data parallelism.

:mod:`.plan` decides which sequences share a row and which data-parallel rank runs it (plain
Python on the step's lengths); :mod:`.rows` lays the per-token values of one row out and back.
Megatron's side (``PackedSeqParams``, block-diagonal attention) is
:mod:`megatron_logra.mcore.models.packed_attention`.
"""

from megatron_logra.packing.plan import ALGORITHMS, Pack, PackPlan, plan_packs
from megatron_logra.packing.rows import RowLayout, pack_row, unpack_row

__all__ = ["ALGORITHMS", "Pack", "PackPlan", "RowLayout", "pack_row", "plan_packs", "unpack_row"]
