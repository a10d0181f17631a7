"""Sync records as bytes: an 8-byte header length, a JSON header, then the raw tensor bytes.

``wire_dtype`` (``fp32`` or ``bf16``) is the dtype of the factors and dense values on the wire.
A record is encoded in it only if that loses nothing: the engine's shadow is exact only if it
receives exactly what the trainer merged. bf16 therefore fits the paper mode with
``logra.update_factor_dtype=bf16`` (its merged factor is bf16-rounded, ``lr = 1``) and bf16 native
parameters; library mode merges fp32 factors and needs ``fp32``. Full-sync tensors always travel
in their own dtype (they carry exact state: fp32 masters).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

from megatron_logra.sync.delta import DeltaBucket, delta_from_header, delta_header
from megatron_logra.sync.records import (
    DenseUpdate,
    FactorPiece,
    FullSyncBucket,
    LowRankUpdate,
    SyncRecord,
)

PROTOCOL_VERSION = 2
"""The version of this encoding and of the records' fields; an engine process built from another
version refuses to start (bump it with any change to ``encode`` / ``decode`` or the records)."""
WIRE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
_TENSOR_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float64": torch.float64,
}
_HEADER_LENGTH = struct.Struct("<Q")


def _to_wire(tensor: torch.Tensor, wire_dtype: str, what: str) -> torch.Tensor:
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype {wire_dtype!r} is not one of {sorted(WIRE_DTYPES)}")
    target = WIRE_DTYPES[wire_dtype]
    wire = tensor.detach().to(target)
    if not torch.equal(wire.to(tensor.dtype), tensor):
        raise ValueError(
            f"{what} ({tensor.dtype}) is not exact in wire_dtype={wire_dtype}: the engine would "
            "drift from the trainer. Use wire_dtype=fp32, or merge bf16 factors (logra.mode=paper "
            "with logra.update_factor_dtype=bf16)"
        )
    return wire


class _Payload:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.offset = 0

    def add(self, tensor: torch.Tensor) -> dict[str, Any]:
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                **self.add_bytes(data)}

    def add_bytes(self, data: bytes) -> dict[str, Any]:
        spec = {"offset": self.offset, "nbytes": len(data)}
        self.chunks.append(data)
        self.offset += len(data)
        return spec


def encode(record: SyncRecord | DeltaBucket, *, wire_dtype: str) -> bytes:
    """The bytes of ``record``; raises ValueError if ``wire_dtype`` would round a tensor."""
    payload = _Payload()
    header: dict[str, Any]
    if isinstance(record, LowRankUpdate):
        pieces = [
            {"row_ranges": [list(r) for r in p.row_ranges], "col_start": p.col_start,
             "col_end": p.col_end,
             "factor": payload.add(_to_wire(p.factor_OR, wire_dtype,
                                            f"the factor of {record.layer_key}"))}
            for p in record.pieces
        ]
        fields = {k: getattr(record, k) for k in (
            "layer_key", "update_count", "seed", "projection_count", "distribution",
            "sketch_rank", "in_features", "projection_dtype", "lr", "weight_decay")}
        header = {"type": "low_rank", **fields, "pieces": pieces}
    elif isinstance(record, DenseUpdate):
        header = {"type": "dense", "name": record.name, "update_count": record.update_count,
                  "value": payload.add(_to_wire(record.value, wire_dtype, record.name))}
    elif isinstance(record, FullSyncBucket):
        header = {"type": "full", "update_count": record.update_count, "index": record.index,
                  "num_buckets": record.num_buckets,
                  "tensors": {name: payload.add(t) for name, t in record.tensors.items()}}
    elif isinstance(record, DeltaBucket):
        header = delta_header(record, payload.add_bytes)  # compressed frames, no wire dtype
    else:
        raise TypeError(f"not a sync record: {type(record).__name__}")
    # Python's float repr round-trips exactly, so lr and weight decay arrive bit for bit.
    head = json.dumps(header).encode()
    return _HEADER_LENGTH.pack(len(head)) + head + b"".join(payload.chunks)


def _tensor(blob: memoryview, spec: dict[str, Any], as_dtype: torch.dtype | None) -> torch.Tensor:
    dtype = _TENSOR_DTYPES[spec["dtype"]]
    if spec["nbytes"] == 0:
        tensor = torch.empty(spec["shape"], dtype=dtype)
    else:
        raw = bytearray(blob[spec["offset"] : spec["offset"] + spec["nbytes"]])
        tensor = torch.frombuffer(raw, dtype=dtype).reshape(spec["shape"])
    return tensor if as_dtype is None else tensor.to(as_dtype)


def decode(data: bytes) -> SyncRecord | DeltaBucket:
    """The record :func:`encode` wrote; factors come back as fp32 (exactly: they were exact)."""
    (length,) = _HEADER_LENGTH.unpack_from(data)
    header = json.loads(data[_HEADER_LENGTH.size : _HEADER_LENGTH.size + length])
    blob = memoryview(data)[_HEADER_LENGTH.size + length :]
    kind = header.pop("type")
    if kind == "low_rank":
        pieces = tuple(
            FactorPiece(tuple(tuple(r) for r in p["row_ranges"]), p["col_start"], p["col_end"],
                        _tensor(blob, p["factor"], torch.float32))
            for p in header.pop("pieces")
        )
        return LowRankUpdate(**header, pieces=pieces)
    if kind == "dense":
        return DenseUpdate(header["name"], header["update_count"],
                           _tensor(blob, header["value"], None))
    if kind == "full":
        return FullSyncBucket(header["update_count"], header["index"], header["num_buckets"],
                              {n: _tensor(blob, s, None) for n, s in header["tensors"].items()})
    if kind == "delta":
        return delta_from_header(header, blob)
    raise ValueError(f"unknown sync record type {kind!r}")
