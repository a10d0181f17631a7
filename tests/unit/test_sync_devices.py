"""Policy sync from a trainer on an accelerator (issue 21 item 1), shown on CPU.

A CUDA trainer's merged factors live in device memory, which the sync path cannot gather
between processes or encode: ``.numpy()`` refuses it and a pickled CUDA tensor names the
sender's device. :class:`AcceleratorTensor` behaves as device memory does where the sync code
touches it (it reports a CUDA device, refuses ``.numpy()`` with CUDA's own message and leaves
only by an explicit copy to the host), so the records' host copy is tested here; the real CUDA
run is ``tools/gpu_check.py``'s ``sync_megatron`` / ``vllm`` sections.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.sync.records import (
    FactorPiece,
    LowRankUpdate,
    combine_rank_records,
    host_factor,
)
from megatron_logra.sync.wire import decode, encode

ROWS, COLS, SKETCH_RANK = 6, 10, 3
_CUDA_NUMPY_ERROR = ("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy "
                     "the tensor to host memory first.")


class AcceleratorTensor(torch.Tensor):
    """A stand-in for a tensor in CUDA memory: its values are host memory, but it reports
    ``cuda:0``, ``.numpy()`` raises as CUDA's does, and ``.cpu()`` / ``.to("cpu")`` return an
    ordinary host tensor (every other op keeps it on the "device")."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def numpy(self, *args, **kwargs):  # noqa: ANN201 -- refuses, as device memory does
        raise TypeError(_CUDA_NUMPY_ERROR)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_host = func is torch.Tensor.cpu or (
            func is torch.Tensor.to and any(
                str(a) == "cpu" for a in (*args[1:], kwargs.get("device"))))
        if to_host:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(torch.Tensor)
        return super().__torch_function__(func, types, args, kwargs)


def _on_accelerator(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone().as_subclass(AcceleratorTensor)


def _record(piece: FactorPiece) -> LowRankUpdate:
    return LowRankUpdate(
        layer_key="decoder.layers.0.mlp.linear_fc2", update_count=1, seed=3, projection_count=0,
        distribution="rademacher", sketch_rank=SKETCH_RANK, in_features=COLS,
        projection_dtype="float32", lr=0.5, weight_decay=0.0, pieces=(piece,))


def test_the_stand_in_refuses_numpy_as_a_cuda_tensor_does():
    factor = _on_accelerator(torch.ones(ROWS, SKETCH_RANK))
    assert factor.device.type == "cuda"
    assert isinstance(factor.detach().clone(), AcceleratorTensor)  # a clone stays on the device
    with pytest.raises(TypeError, match="can't convert cuda"):
        factor.detach().clone().numpy()


def test_a_record_refuses_a_factor_left_in_device_memory_naming_the_host_copy():
    # What LoGRAOptimizer._sync_record built before the fix: a clone on the trainer's device.
    factor = _on_accelerator(torch.ones(ROWS, SKETCH_RANK))
    with pytest.raises(ValueError, match="on cuda:0: .* host_factor"):
        FactorPiece(((0, ROWS),), 0, COLS, factor.detach().clone())


def test_a_device_factors_host_copy_crosses_gather_and_wire_bit_for_bit():
    values = torch.randn(ROWS, SKETCH_RANK, generator=torch.Generator().manual_seed(0))
    factor = _on_accelerator(values)
    piece = FactorPiece(((0, ROWS),), 0, COLS, host_factor(factor))
    assert type(piece.factor_OR) is torch.Tensor and piece.factor_OR.device.type == "cpu"
    factor.mul_(0.0)  # the trainer reuses its buffer next step: the record must not follow it
    # Two DP replicas' records (compared bit for bit) and the wire, as PolicySync ships them.
    replica = FactorPiece(((0, ROWS),), 0, COLS, host_factor(_on_accelerator(values)))
    (combined,) = combine_rank_records([[_record(piece)], [_record(replica)]])
    back = decode(encode(combined, wire_dtype="fp32"))
    assert len(back.pieces) == 1 and torch.equal(back.pieces[0].factor_OR, values)
