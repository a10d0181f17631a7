"""A layout-independent digest of a checkpoint's full model weights.

dist_checkpointing stores every tensor under its global key with its global shape (decoder
layers stacked on a leading layer axis), so reading the checkpoint back as plain tensors yields
the same full weights whatever TP/PP/DP layout wrote it. The digest hashes, in key order, each
model tensor's key, shape and float32 bytes: two checkpoints have the same digest exactly when
they hold bit-identical weights. Per-tensor norms (``tensor_norms``) compare checkpoints from
different layouts within a tolerance, where float rounding makes bitwise equality the wrong test.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from megatron.core import dist_checkpointing

# Keys that are not model weights: optimizer state, LoGRA state, RNG, module extra state.
_NON_MODEL_PREFIXES = ("optimizer.", "chained_", "logra.", "rng_state")


def is_model_key(key: str) -> bool:
    return not key.startswith(_NON_MODEL_PREFIXES) and "_extra_state" not in key


def load_full_weights(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every model tensor of the checkpoint as a full fp32 tensor (needs a process group)."""
    loaded = dist_checkpointing.load_plain_tensors(str(checkpoint_dir))
    # Besides tensors the result holds the common (non-sharded) state as nested dicts.
    return {
        key: value.float() for key, value in sorted(loaded.items())
        if isinstance(value, torch.Tensor) and is_model_key(key)
    }


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for key in sorted(weights):
        tensor = weights[key].detach().to(torch.float32).contiguous().cpu()
        digest.update(key.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def tensor_norms(weights: dict[str, torch.Tensor]) -> dict[str, float]:
    return {key: float(weights[key].double().norm()) for key in sorted(weights)}
