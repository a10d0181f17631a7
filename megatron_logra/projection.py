"""Counter-based random projections ``A [sketch_rank, in_features]`` for LoGRA.

LoGRA sketches the gradient of a weight ``W [m, n]`` as ``S = G A^T`` with a random ``A [r, n]``
that is redrawn after every update. Everything else in the system depends on ``A`` being a pure
function of ``(base_seed, update_count, layer_key)``:

* every data-parallel replica must hold the same ``A`` (their sketches are summed);
* a row-parallel tensor-parallel shard owns input columns ``lo:hi`` and needs exactly the slice
  ``A[:, lo:hi]`` of the global matrix, without materialising the rest;
* a resumed run and a rollout engine regenerate ``A`` from the seed instead of storing it.

So ``A`` is not drawn from a ``torch.Generator``. Each entry ``A[i, j]`` is a keyed hash of the row
``i`` and the *global* column ``j``, computed with exact 32-bit integer arithmetic held in int64
tensors (no overflow, no signed shifts), which gives bit-identical Rademacher matrices on any
device, for any column slice, in any process. Gaussian entries pass through ``log``/``cos`` in
float64, so across devices they agree only to floating-point rounding of those functions.

Shape suffixes in this file: R = sketch rank (rows of A), I = input features (columns of A).
"""

from __future__ import annotations

import hashlib
import math
from typing import Literal

import torch

Distribution = Literal["rademacher", "gaussian", "identity"]
DISTRIBUTIONS: tuple[str, ...] = ("rademacher", "gaussian", "identity")

_MASK32 = 0xFFFFFFFF
# Columns generated per block: bounds the int64 temporaries to ~sketch_rank * 8192 * 8 bytes.
_COLUMN_BLOCK = 8192


def projection_key(base_seed: int, update_count: int, layer_key: str) -> tuple[int, int]:
    """Derive the two 32-bit hash keys of one projection.

    BLAKE2b of a canonical string, so the key is stable across processes, Python versions and
    machines (unlike the salted built-in ``hash``).
    """
    if base_seed < 0 or update_count < 0:
        raise ValueError(
            f"projection seeds must be non-negative, got base_seed={base_seed}, "
            f"update_count={update_count}"
        )
    material = f"megatron_logra.projection.v1|{base_seed}|{update_count}|{layer_key}".encode()
    digest = hashlib.blake2b(material, digest_size=8).digest()
    word = int.from_bytes(digest, "little")
    return word & _MASK32, (word >> 32) & _MASK32


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``(x * constant) mod 2**32`` for int64 tensors holding values in ``[0, 2**32)``.

    The product is split at 16 bits so that no intermediate exceeds 2**49: signed int64
    overflow is undefined behaviour in the kernels, and we need the same bits everywhere.
    """
    low = (x & 0xFFFF) * constant
    high = ((x >> 16) * constant) & 0xFFFF
    return (low + (high << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash with full avalanche (xorshift-multiply, 'lowbias32')."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _hash_grid(
    key: tuple[int, int], rows: torch.Tensor, cols: torch.Tensor, salt: int
) -> torch.Tensor:
    """Keyed hash of every (row, column) pair: int64 values in ``[0, 2**32)``, shape [R, I].

    ``h = mix(r ^ mix(r ^ c))`` with ``r = mix(k0 ^ row)`` and ``c = mix(k1 ^ col ^ salt)``.
    The inner XOR alone would make whole rows shifted copies of each other whenever two row
    keys differ by a small value; the second, row-keyed round removes that structure.
    """
    k0, k1 = key
    row_keys_R = _mix32(rows ^ k0)
    col_keys_I = _mix32(cols ^ (k1 ^ salt))
    inner_RI = _mix32(row_keys_R[:, None] ^ col_keys_I[None, :])
    return _mix32(row_keys_R[:, None] ^ inner_RI)


def generate_projection(
    key: tuple[int, int],
    sketch_rank: int,
    col_start: int,
    col_end: int,
    distribution: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Columns ``col_start:col_end`` of the projection ``A [sketch_rank, n]`` for ``key``.

    Args:
        key: from :func:`projection_key`.
        sketch_rank: rows of A. For ``identity`` it must equal the layer's global input width n.
        col_start, col_end: the global column range to produce; any slice of A can be produced
            alone and equals the same slice of the full matrix bit for bit.
        distribution: ``rademacher`` (entries +-1/sqrt(r)), ``gaussian`` (N(0, 1/r)) or
            ``identity`` (A = I; a test device, the dense-gradient limit).

    Returns:
        A tensor ``[sketch_rank, col_end - col_start]`` of ``dtype`` on ``device``.
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(
            f"projection distribution {distribution!r} is not one of {DISTRIBUTIONS}"
        )
    if sketch_rank <= 0:
        raise ValueError(f"sketch_rank must be positive, got {sketch_rank}")
    if not 0 <= col_start <= col_end or col_end >= 2**32:
        raise ValueError(f"invalid column range [{col_start}, {col_end})")

    width = col_end - col_start
    if distribution == "identity":
        rows_R = torch.arange(sketch_rank, device=device)
        cols_I = torch.arange(col_start, col_end, device=device)
        return (rows_R[:, None] == cols_I[None, :]).to(dtype)

    out_RI = torch.empty(sketch_rank, width, dtype=dtype, device=device)
    rows_R = torch.arange(sketch_rank, dtype=torch.int64, device=device)
    scale = 1.0 / math.sqrt(sketch_rank)
    for block_start in range(col_start, col_end, _COLUMN_BLOCK):
        block_end = min(block_start + _COLUMN_BLOCK, col_end)
        cols_I = torch.arange(block_start, block_end, dtype=torch.int64, device=device)
        bits_RI = _hash_grid(key, rows_R, cols_I, salt=0)
        if distribution == "rademacher":
            # The top bit of the hash picks the sign; values are exactly +-1/sqrt(r) in any dtype
            # that can hold them, so the matrix is bit-identical across devices.
            signs_RI = ((bits_RI >> 31) * 2 - 1).to(torch.float64)
            block_RI = signs_RI * scale
        else:
            # Box-Muller on two independent 24-bit uniforms in (0, 1), in float64.
            second_RI = _hash_grid(key, rows_R, cols_I, salt=0x5BD1E995)
            u1 = ((bits_RI >> 8).to(torch.float64) + 0.5) / 2.0**24
            u2 = ((second_RI >> 8).to(torch.float64) + 0.5) / 2.0**24
            block_RI = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2) * scale
        out_RI[:, block_start - col_start : block_end - col_start] = block_RI.to(dtype)
    return out_RI
