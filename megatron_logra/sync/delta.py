"""Sparse-delta policy sync (``sync.mode=delta``): the XOR of the engine's weights' bit patterns
against the trainer's, compressed with zstd, for any optimizer (docs/sync.md, "Delta sync").

At RL learning rates most bf16 weights do not change in a step, so the XOR of the old and new
bit patterns is mostly zero bytes, which zstd compresses to little. No arithmetic touches a
weight: the engine XORs the same bits back and holds the trainer's bits exactly, on any device
and for any optimizer -- no fp32 shadow, no replay. The trainer keeps what the engine holds (the
state of the last sync, in host memory) to XOR against.

A :class:`DeltaBucket` carries, per changed tensor, its own frame (zstd) of the XOR bytes, the
update count the engine must hold it at (``base_count``: an out-of-order or repeated delta would
XOR against other bits) and a BLAKE2b digest of the XOR bytes (a corrupt frame is refused naming
the tensor). Tensors that did not change travel not at all (their base count stays). Full syncs
reset the base as for every mode.

"What the engine holds" is its exact state: the served weight, or, for a LoGRA target the engine
keeps an fp32 shadow of (``sync.mode=low_rank`` / ``auto``), that fp32 master; the trainer XORs
the same thing (:func:`megatron_logra.train.rl.policy_sync` chooses).

Torch, the standard library and ``zstandard`` only: vLLM's workers load this in their own venv.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

ZSTD_LEVEL = 3
"""zstd's default level: on the XOR streams of the sync benchmark, levels above it gained a few
percent of bytes for several times the time (docs/sync.md)."""
_BITS: dict[torch.dtype, torch.dtype] = {
    torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
    torch.float64: torch.int64,
}
"""The integer type whose bit pattern a weight's dtype is XORed as."""
_DIGEST_BYTES = 8


def _zstd():
    try:
        import zstandard
    except ModuleNotFoundError as error:  # pragma: no cover -- pinned in requirements.lock
        raise RuntimeError("sync.mode=delta needs the zstandard package (requirements.lock; "
                           "make setup-vllm installs it into vLLM's venv)") from error
    return zstandard


def xor_bits(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new ^ old`` of the two tensors' bit patterns, as the integer type of their width."""
    if new.dtype != old.dtype or new.shape != old.shape:
        raise ValueError(f"XOR of a {new.dtype} {tuple(new.shape)} and a {old.dtype} "
                         f"{tuple(old.shape)} tensor")
    if new.dtype not in _BITS:
        raise ValueError(f"delta sync has no bit pattern for {new.dtype}")
    bits = _BITS[new.dtype]
    return torch.bitwise_xor(new.contiguous().view(bits), old.contiguous().view(bits))


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).hexdigest()


@dataclass(frozen=True)
class TensorDelta:
    """One tensor's XOR (compressed), what it applies to and how to check it.

    Attributes:
        dtype, shape: of the full (TP=1) tensor.
        base_count: the update the engine must hold the tensor at.
        changed: how many elements differ (the XOR's nonzero elements).
        digest: BLAKE2b of the uncompressed XOR bytes.
        frame: the zstd frame of those bytes.
    """

    dtype: str
    shape: tuple[int, ...]
    base_count: int
    changed: int
    digest: str
    frame: bytes

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


@dataclass(frozen=True)
class DeltaBucket:
    """The changed tensors of one bucket of update ``update_count``'s delta.

    Buckets of one update are independent (their tensors are disjoint): each checks and applies
    on its own; ``index`` / ``num_buckets`` say where it sits for logs."""

    update_count: int
    index: int
    num_buckets: int
    tensors: dict[str, TensorDelta] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """The compressed bytes this bucket carries."""
        return sum(len(t.frame) for t in self.tensors.values())


_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in _BITS}


def tensor_delta(new: torch.Tensor, old: torch.Tensor, *, base_count: int,
                 compressor=None) -> TensorDelta | None:
    """The delta that turns ``old`` into ``new`` (host tensors of one dtype); None if equal."""
    xor = xor_bits(new.detach().cpu(), old.detach().cpu())
    changed = int(torch.count_nonzero(xor))
    if not changed:
        return None
    raw = xor.numpy().tobytes()
    compressor = compressor or _zstd().ZstdCompressor(level=ZSTD_LEVEL)
    return TensorDelta(str(new.dtype).removeprefix("torch."), tuple(new.shape), base_count,
                       changed, _digest(raw), compressor.compress(raw))


def delta_buckets(new: Mapping[str, torch.Tensor], old: Mapping[str, torch.Tensor],
                  base_counts: Mapping[str, int], *, update_count: int,
                  bucket_bytes: int) -> list[DeltaBucket]:
    """The deltas that bring ``old`` (what the engine holds, at ``base_counts``) to ``new``, in
    buckets of at most ``bucket_bytes`` of uncompressed tensor bytes (one larger tensor gets its
    own), in ``new``'s order. Unchanged tensors are left out; no bucket at all if none changed."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if new.keys() != old.keys():
        raise ValueError(f"delta of different tensor sets: only new "
                         f"{sorted(new.keys() - old.keys())[:4]}, only old "
                         f"{sorted(old.keys() - new.keys())[:4]}")
    compressor = _zstd().ZstdCompressor(level=ZSTD_LEVEL)
    groups: list[dict[str, TensorDelta]] = [{}]
    size = 0
    for name, tensor in new.items():
        base = base_counts[name]
        if update_count <= base:
            raise ValueError(f"delta of {name} to update {update_count} from update {base}")
        delta = tensor_delta(tensor, old[name], base_count=base, compressor=compressor)
        if delta is None:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > bucket_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = delta
        size += nbytes
    groups = [g for g in groups if g]
    return [DeltaBucket(update_count, i, len(groups), g) for i, g in enumerate(groups)]


def decoded_xor(name: str, delta: TensorDelta) -> torch.Tensor:
    """The XOR bits of ``delta`` (full shape, the integer type of its dtype), after checking the
    frame and its digest; RuntimeError naming ``name`` if either is corrupt."""
    zstandard = _zstd()
    dtype = _TORCH_DTYPES.get(delta.dtype)
    if dtype is None:
        raise RuntimeError(f"delta of {name}: no bit pattern for dtype {delta.dtype}")
    expected = delta.numel * torch.empty((), dtype=dtype).element_size()
    try:
        raw = zstandard.ZstdDecompressor().decompress(delta.frame, max_output_size=expected)
    except zstandard.ZstdError as error:
        raise RuntimeError(f"refusing delta of {name} (update base {delta.base_count}): its zstd "
                           f"frame is corrupt ({error}); request a full sync") from error
    if len(raw) != expected or _digest(raw) != delta.digest:
        raise RuntimeError(f"refusing delta of {name} (update base {delta.base_count}): its "
                           f"bytes do not match their checksum; request a full sync")
    return torch.frombuffer(bytearray(raw), dtype=_BITS[dtype]).reshape(delta.shape)


def apply_xor_(held: torch.Tensor, xor: torch.Tensor) -> None:
    """``held ^= xor`` on ``held``'s bit pattern, in place."""
    bits = _BITS[held.dtype]
    view = held.view(bits)
    view.bitwise_xor_(xor.to(view.device))


# ---------------------------------------------------------------------- the wire


def delta_header(bucket: DeltaBucket, add_bytes) -> dict:
    """The JSON header of ``bucket``; ``add_bytes(frame)`` appends a frame to the record's tensor
    bytes and returns its ``{offset, nbytes}``."""
    return {
        "type": "delta", "update_count": bucket.update_count, "index": bucket.index,
        "num_buckets": bucket.num_buckets,
        "tensors": {name: {"dtype": t.dtype, "shape": list(t.shape), "base_count": t.base_count,
                           "changed": t.changed, "digest": t.digest,
                           "frame": add_bytes(t.frame)}
                    for name, t in bucket.tensors.items()},
    }


def delta_from_header(header: dict, blob: memoryview) -> DeltaBucket:
    def frame(spec: dict) -> bytes:
        return bytes(blob[spec["offset"]: spec["offset"] + spec["nbytes"]])

    tensors = {name: TensorDelta(t["dtype"], tuple(t["shape"]), t["base_count"], t["changed"],
                                 t["digest"], frame(t["frame"]))
               for name, t in header["tensors"].items()}
    return DeltaBucket(header["update_count"], header["index"], header["num_buckets"], tensors)
