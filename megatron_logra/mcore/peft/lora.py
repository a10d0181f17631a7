"""LoRA adapters on Megatron's tensor-parallel target linears: the baseline LoGRA is measured against.

:func:`attach_lora` freezes every parameter of the model and gives each target linear (the same
ones LoGRA sketches, found by :func:`~megatron_logra.mcore.models.targets.find_targets`) a trainable
:class:`LoRAAdapter` child with ``A [r, n_local]`` and ``B [m_local, r]``. The layer's output
becomes ``Y + scale * (X A^T) B^T`` with ``scale = alpha / r``. ``B`` starts at zero, so the model
computes exactly what it computed before; ``A`` is drawn as the full ``[r, n]`` matrix from a
generator seeded by ``(seed, layer key)`` and sliced like the layer's input, so every TP size
starts from the same adapters.

Tensor parallelism follows the base layer (A is split like the input, B like the output):

* column-parallel ``W [m/tp, n]``: A replicated, B split by rows. Every rank projects its input;
  the ``[T, r]`` product enters the TP region with Megatron's ``copy_to`` (backward all-reduces
  the partial ``dP`` that each rank's B rows produce), or, under sequence parallelism, is
  all-gathered from the local sequence shard (backward reduce-scatters). Under SP each rank
  sees only its tokens, so A's gradient is a partial sum over TP: A is marked
  ``sequence_parallel`` and Megatron's ``finalize_model_grads`` all-reduces it, as it does for
  the norms.
* row-parallel ``W [m, n/tp]``: A split by input columns, B replicated. The partial ``[T, r]``
  products are all-reduced over TP, or reduce-scattered along the sequence under SP (where the
  layer's own output is sequence-sharded); then B's gradient is partial over TP and B is marked
  ``sequence_parallel``.

All communication goes through Megatron's autograd-aware mapping functions. Replicated adapters
carry Megatron's default TP attributes, so its gradient-norm filter counts them once.

The adapters are submodules of the target linears: Megatron's DDP and optimizer pick them up
like any parameter, they appear in ``state_dict``, and each target linear's
``sharded_state_dict`` is extended to shard them along their TP split (including the
interleaved gate/up rows of a gated fc1), so a LoRA checkpoint reshards across TP layouts.
"""

from __future__ import annotations

import hashlib
import math
import types
from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)

from megatron_logra.mcore.models.grad_anchor import anchor_embedding_output
from megatron_logra.mcore.models.targets import SketchTarget, find_targets
from megatron_logra.mcore.process_groups import ParallelGroups

ADAPTER_ATTR = "lora"
"""Name of the adapter submodule on a target linear (its parameters: ``lora.a``, ``lora.b``)."""


class LoRAAdapter(torch.nn.Module):
    """The low-rank branch ``scale * (X A^T) B^T`` of one target linear on this rank.

    Attributes:
        a: ``[r, n_local]`` down-projection (column: the full input width; row: this rank's
            input columns).
        b: ``[m_local, r]`` up-projection (column: this rank's output rows; row: all rows).
        layer_key: the target's stable global name (seeds A).
        parallel_kind: ``column`` or ``row``, as the base layer.
        scale: ``alpha / lora_rank``.
    """

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        layer_key: str,
        parallel_kind: str,
        scale: float,
        sequence_parallel: bool,
        tp_group: torch.distributed.ProcessGroup,
    ) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(a)
        self.b = torch.nn.Parameter(b)
        self.layer_key = layer_key
        self.parallel_kind = parallel_kind
        self.scale = scale
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    @property
    def lora_rank(self) -> int:
        return self.a.shape[0]

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """The branch's contribution to the base layer's (TP-local) output for ``input_``."""
        projected = torch.matmul(input_, self.a.t())
        if self.parallel_kind == "column":
            if self.sequence_parallel:
                # The input is this rank's sequence shard; the layer's output covers every token.
                projected = gather_from_sequence_parallel_region(
                    projected, tensor_parallel_output_grad=True, group=self.tp_group
                )
            else:
                projected = copy_to_tensor_model_parallel_region(projected, group=self.tp_group)
        elif self.sequence_parallel:
            projected = reduce_scatter_to_sequence_parallel_region(projected, group=self.tp_group)
        else:
            projected = reduce_from_tensor_model_parallel_region(projected, group=self.tp_group)
        # Scale the [T, r] product rather than the [T, m] output: same result, fewer flops.
        return torch.matmul(projected * self.scale, self.b.t())


def _add_adapter_output(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """Forward hook of a target linear: ``(Y, bias) -> (Y + adapter(X), bias)``."""
    if not args:
        raise TypeError(f"{module.lora.layer_key}: expected the layer input as a positional "
                        "argument (Megatron calls its linears that way)")
    result, bias = output
    return result + module.lora(args[0]), bias


def _adapter_sharded_state_dict(
    self: torch.nn.Module, prefix: str = "", sharded_offsets: tuple = (),
    metadata: dict | None = None,
) -> dict[str, Any]:
    """The target linear's ``sharded_state_dict`` with its adapter sharded like its TP split.

    Megatron's own implementation treats every key it does not know (the adapter's) as
    replicated over TP, which would save only TP rank 0's shard of a split adapter.
    """
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    adapter: LoRAAdapter = getattr(self, ADAPTER_ATTR)
    if adapter.parallel_kind == "column":
        axis_map = {"weight": 0, "bias": 0, f"{ADAPTER_ATTR}.b": 0}
    else:
        axis_map = {"weight": 1, f"{ADAPTER_ATTR}.a": 1}
    state = make_sharded_tensors_for_checkpoint(
        self.state_dict(prefix="", keep_vars=True), prefix, axis_map, sharded_offsets,
        tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
    )
    b_key = f"{prefix}{ADAPTER_ATTR}.b"
    if int(getattr(adapter.b, "partition_stride", 1)) == 2:
        # A gated fc1 holds [gate_t; up_t] rows; B's rows follow W's, and are saved as the
        # two halves Megatron's MLP saves W as (it only rewrites the weight and bias keys).
        state[b_key] = apply_swiglu_sharded_factory(
            state[b_key], sharded_offsets, metadata.get("singleton_local_shards", False)
        )
    return state


def _seed_for(seed: int, layer_key: str) -> int:
    digest = hashlib.blake2b(f"megatron_logra.lora|{seed}|{layer_key}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & (2**63 - 1)


def full_down_projection(seed: int, layer_key: str, lora_rank: int, in_features: int) -> torch.Tensor:
    """The full ``[r, n]`` initial A of one target (fp32, CPU): uniform in ``+-1/sqrt(n)``,
    the bound of torch's default Linear initialisation for an input width of n."""
    generator = torch.Generator(device="cpu").manual_seed(_seed_for(seed, layer_key))
    bound = 1.0 / math.sqrt(in_features)
    full = torch.empty(lora_rank, in_features, dtype=torch.float32)
    return full.uniform_(-bound, bound, generator=generator)


def _validate(lora_rank: int, alpha: float, seed: int, target_names: Sequence[str]) -> None:
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1:
        raise ValueError(f"lora_rank={lora_rank!r} must be a positive integer, e.g. 256")
    if not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha={alpha!r} must be a finite number > 0 (scale = alpha / rank)")
    if seed < 0:
        raise ValueError(f"seed={seed} must be >= 0")
    if not target_names:
        raise ValueError("target_names is empty; name at least one target linear, e.g. "
                         "linear_qkv")


def _check_layer(target: SketchTarget) -> None:
    module = target.module
    if target.module.logra_sketch is not None:
        raise ValueError(f"{target.layer_key} is sketched by LoGRA; LoRA and LoGRA are "
                         "alternative methods: use one per model")
    if hasattr(module, ADAPTER_ATTR):
        raise ValueError(f"{target.layer_key} already has a LoRA adapter; attach_lora once "
                         "per model")
    if target.parallel_kind == "column" and getattr(module, "gather_output", False):
        raise ValueError(f"{target.layer_key} gathers its output over TP; LoRA expects the "
                         "TP-local output of a target linear (gather_output=False)")
    if target.parallel_kind == "row" and not getattr(module, "input_is_parallel", True):
        raise ValueError(f"{target.layer_key} splits its input itself; LoRA expects a "
                         "row-parallel target with input_is_parallel=True")


def attach_lora(
    model_chunks: Sequence[torch.nn.Module],
    target_names: Sequence[str],
    *,
    lora_rank: int,
    alpha: float,
    groups: ParallelGroups,
    seed: int,
) -> list[LoRAAdapter]:
    """Freeze ``model_chunks`` and add a LoRA adapter to every target linear; returns them in
    layer order. Call before Megatron's DDP and optimizer are built (they collect the
    parameters that require grad: exactly the adapters). The embedding's output is anchored to
    require grad (mcore/models/grad_anchor.py)."""
    _validate(lora_rank, alpha, seed, target_names)
    targets = find_targets(model_chunks, target_names, tp_rank=groups.tp_rank)
    for target in targets:
        _check_layer(target)
    for chunk in model_chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
    # A frozen embedding: without the anchor, full recompute would never reach the adapters.
    anchor_embedding_output(model_chunks)
    scale = alpha / lora_rank
    adapters = []
    for target in targets:
        module, weight = target.module, target.weight
        full_a = full_down_projection(seed, target.layer_key, lora_rank, target.in_features)
        a = full_a[:, target.col_start:target.col_end].to(device=weight.device, dtype=weight.dtype)
        b = torch.zeros(weight.shape[0], lora_rank, device=weight.device, dtype=weight.dtype)
        sequence_parallel = bool(module.sequence_parallel)
        adapter = LoRAAdapter(
            a.contiguous(), b, layer_key=target.layer_key, parallel_kind=target.parallel_kind,
            scale=scale, sequence_parallel=sequence_parallel, tp_group=module.tp_group,
        )
        if target.parallel_kind == "column":
            set_defaults_if_not_set_tensor_model_parallel_attributes(adapter.a)
            set_tensor_model_parallel_attributes(adapter.b, True, 0, target.stride)
            partial_over_sequence = adapter.a
        else:
            set_tensor_model_parallel_attributes(adapter.a, True, 1, 1)
            set_defaults_if_not_set_tensor_model_parallel_attributes(adapter.b)
            partial_over_sequence = adapter.b
        # Under SP this replicated adapter's gradient sums only this rank's tokens; Megatron's
        # finalize_model_grads all-reduces the grads of parameters marked like this over TP.
        partial_over_sequence.sequence_parallel = sequence_parallel
        module.add_module(ADAPTER_ATTR, adapter)
        module.register_forward_hook(_add_adapter_output)
        module.sharded_state_dict = types.MethodType(_adapter_sharded_state_dict, module)
        adapters.append(adapter)
    return adapters


def lora_adapters(model_chunks: Sequence[torch.nn.Module]) -> list[LoRAAdapter]:
    """The adapters :func:`attach_lora` added to ``model_chunks`` (through any wrappers)."""
    return [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, LoRAAdapter)]
