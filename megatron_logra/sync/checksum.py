"""A deterministic digest of a weight, so the trainer and the engine can compare their weights.

BLAKE2b of the tensor's dtype, shape and raw bytes: equal digests mean equal bits (up to a 2^-64
collision), and any one-ulp change changes the digest. Both sides call the same function on
the weights they serve (on CPU it hashes ~1 GB/s; a device-side digest is future work).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

_DIGEST_BYTES = 8


def weight_checksum(tensor: torch.Tensor) -> str:
    """Hex digest of ``tensor``'s dtype, shape and bytes."""
    digest = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    digest.update(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.numel():
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def weight_checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    return {name: weight_checksum(tensor) for name, tensor in named}


def mismatched_weights(trainer: dict[str, str], engine: dict[str, str]) -> list[str]:
    """Names whose digests differ or that only one side has (sorted)."""
    return sorted(n for n in trainer.keys() | engine.keys() if trainer.get(n) != engine.get(n))
