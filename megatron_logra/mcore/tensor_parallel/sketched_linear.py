"""Megatron tensor-parallel linears that sketch their weight gradient instead of forming it.

``SketchedColumnParallelLinear`` and ``SketchedRowParallelLinear`` are Megatron's own
``ColumnParallelLinear`` / ``RowParallelLinear`` with one seam overridden: ``_forward_impl``, the
place where Megatron picks its linear autograd Function. With no sketch attached they are exactly
Megatron's layers (the dense baselines run on the same model class). With a
:class:`LayerSketch` attached and autograd recording, the layer runs :class:`_SketchedLinear`:

* forward computes ``Y = X W^T (+ b)`` as Megatron does and keeps only ``P = X A^T`` (and W,
  which is a parameter) for backward -- never X;
* backward computes the input gradient exactly as Megatron does (all-reduce, or reduce-scatter
  under sequence parallelism) and adds ``H^T P`` into the layer's fp32 sketch; it returns no
  weight gradient, so nothing the size of W is ever allocated for it.

Tensor parallelism (DESIGN section 3):

* column-parallel shard ``W [m/tp, n]``: full A; its sketch rows are complete. Under sequence
  parallelism Megatron gathers the input's sequence shards inside the op; here each rank projects
  its *local* shard and the small ``P [T/tp, r]`` is gathered in backward instead of X;
* row-parallel shard ``W [m, n/tp]``: the slice ``A[:, lo:hi]`` of the global A; its sketch is a
  partial sum over the TP group, completed when the step's sketches are reduced.

Shape suffixes: T = tokens (sequence x batch), O = output rows, I = input columns, R = sketch rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_logra.mcore.tensor_parallel.seq_collectives import (
    all_gather_first_dim,
    reduce_scatter_first_dim,
)
from megatron_logra.sketch import project_activations
from megatron_logra.sketch_buffer import FlatSketchBuffer


class LayerSketch:
    """What a sketched layer uses during a step (set and refreshed by the LoGRA optimizer).

    Args:
        layer_key: the layer's stable global name.
        projection: ``A`` (column-parallel) or its column slice (row-parallel), ``[r, n_local]``,
            held once, in the activation dtype (the weights' dtype): the forward projects with
            it as it is, and the fp32 update and norms cast it per layer when they use it.
            Its values were rounded through that dtype when it was drawn, so the cast back is
            exact and forward and update use the same matrix.
        buffer: the flat sketch buffer the layer's rows accumulate into.
    """

    def __init__(self, layer_key: str, projection: torch.Tensor, buffer: FlatSketchBuffer):
        self.layer_key = layer_key
        self.buffer = buffer
        self.projection = projection

    def projection_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The projection in ``dtype``: the held tensor when the dtypes agree (always, in a
        Megatron run: activations come in the weights' dtype), else a transient cast -- never
        a second cached copy beside the first."""
        return self.projection if dtype == self.projection.dtype else self.projection.to(dtype)

    def accumulate_(self, grad_output_TO: torch.Tensor, projected_TR: torch.Tensor) -> None:
        self.buffer.accumulate_(self.layer_key, grad_output_TO, projected_TR)




class _SketchedLinear(torch.autograd.Function):
    """``Y = X W^T + b`` whose backward feeds a sketch instead of producing ``dL/dW``."""

    @staticmethod
    def forward(
        ctx: Any,
        input_: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layer_sketch: LayerSketch,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        tp_group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        projected_local = project_activations(input_, layer_sketch.projection_as(input_.dtype))
        total_input = all_gather_first_dim(input_, tp_group) if sequence_parallel else input_
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        ctx.save_for_backward(projected_local, weight)
        ctx.layer_sketch = layer_sketch
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.tp_group = tp_group
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        projected_local, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.sequence_parallel:
            grad_input = reduce_scatter_first_dim(grad_input, ctx.tp_group)
            projected = all_gather_first_dim(projected_local, ctx.tp_group)
        else:
            if ctx.allreduce_dgrad:
                dist.all_reduce(grad_input, group=ctx.tp_group)
            projected = projected_local
        grad_output_TO = grad_output.reshape(-1, grad_output.shape[-1])
        ctx.layer_sketch.accumulate_(grad_output_TO, projected.reshape(-1, projected.shape[-1]))
        grad_bias = grad_output_TO.sum(dim=0) if ctx.use_bias else None
        return grad_input, None, grad_bias, None, None, None, None


def _sketched_forward_impl(
    layer: ColumnParallelLinear | RowParallelLinear,
    dense_impl: Any,
    input_: torch.Tensor,
    weight: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    layer_sketch: LayerSketch | None = layer.logra_sketch
    if layer_sketch is None or not torch.is_grad_enabled():
        # Dense training, or a forward that records no graph (evaluation, generation, the first
        # pass of activation recompute): exactly Megatron's own path.
        return dense_impl(input_, weight, **kwargs)
    if weight.requires_grad:
        raise RuntimeError(
            f"{layer_sketch.layer_key}: a sketched weight must have requires_grad=False, or "
            "autograd would also build its dense gradient"
        )
    if kwargs.get("gradient_accumulation_fusion") or kwargs.get("grad_output_buffer") is not None:
        raise RuntimeError(
            f"{layer_sketch.layer_key}: gradient_accumulation_fusion and deferred wgrad do not "
            "apply to sketched layers; disable them in the model config"
        )
    tp_group = kwargs.get("tp_group") or layer.tp_group
    return _SketchedLinear.apply(
        input_,
        weight,
        kwargs.get("bias"),
        layer_sketch,
        bool(kwargs.get("allreduce_dgrad", False)),
        bool(kwargs.get("sequence_parallel", False)),
        tp_group,
    )


class SketchedColumnParallelLinear(ColumnParallelLinear):
    """Megatron's ColumnParallelLinear whose weight gradient can be sketched."""

    logra_sketch: LayerSketch | None = None

    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: ANN001 - Megatron's signature
        if args:
            raise TypeError("Megatron passes linear arguments by keyword")
        return _sketched_forward_impl(self, super()._forward_impl, input, weight, **kwargs)


class SketchedRowParallelLinear(RowParallelLinear):
    """Megatron's RowParallelLinear whose weight gradient can be sketched."""

    logra_sketch: LayerSketch | None = None

    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: ANN001 - Megatron's signature
        if args:
            raise TypeError("Megatron passes linear arguments by keyword")
        return _sketched_forward_impl(self, super()._forward_impl, input, weight, **kwargs)
