"""Find the linears LoGRA sketches and give each a stable, layout-independent key."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_logra.mcore.models.moe import expert_index_offset, moe_layers
from megatron_logra.mcore.models.sharding import unwrap_model
from megatron_logra.mcore.tensor_parallel.sketched_linear import (
    SketchedColumnParallelLinear,
    SketchedRowParallelLinear,
)

# Target name -> (attribute path inside a TransformerLayer, tensor-parallel kind).
TARGET_PATHS: dict[str, tuple[str, str]] = {
    "linear_qkv": ("self_attention.linear_qkv", "column"),
    "linear_proj": ("self_attention.linear_proj", "row"),
    "linear_fc1": ("mlp.linear_fc1", "column"),
    "linear_fc2": ("mlp.linear_fc2", "row"),
}

# The layer types a sketched model may be built of (class names, so that Transformer Engine's
# attention is named without importing TE on a CPU machine): Megatron's dense TransformerLayer
# with SelfAttention and an MLP, and the core attention of each model.attention choice.
SUPPORTED_LAYERS: dict[str, tuple[str, ...]] = {
    "": ("TransformerLayer",),
    "self_attention": ("SelfAttention",),
    "self_attention.core_attention": (
        "SDPAttention", "PackedDotProductAttention", "TEDotProductAttention",
    ),
    "mlp": ("MLP", "MoELayer"),
}


def check_supported_layer(layer: torch.nn.Module, global_index: int) -> None:
    """Refuse a decoder layer whose structure the targets and the KL probe were not built for
    (multi-latent attention, grouped-GEMM experts, fused TE layernorm-linears, ...)."""
    for path, names in SUPPORTED_LAYERS.items():
        module = layer
        for attr in filter(None, path.split(".")):
            module = getattr(module, attr, None)
        kind = type(module).__name__
        if kind not in names:
            where = f"decoder.layers.{global_index}" + (f".{path}" if path else "")
            raise TypeError(
                f"{where} is a {kind}; LoGRA supports {' or '.join(names)} there: build the "
                "model with megatron_logra.mcore.models.gpt.gpt_layer_spec (model.attention="
                "sdpa, local or te)"
            )


@dataclass(frozen=True)
class SketchTarget:
    """One sketched linear on this rank.

    Attributes:
        layer_key: ``decoder.layers.<global index>.<path>``; the same on every rank, for every
            TP/PP layout and wrapper, so it seeds the same projection everywhere.
        module: the Megatron layer.
        parallel_kind: ``column`` (owns output rows) or ``row`` (owns input columns).
        in_features: global input width n (columns of the full A).
        col_start, col_end: the global input columns this rank's weight shard covers.
        expert: a routed expert's linear (split over expert parallelism; its sketch is reduced
            over the expert-data-parallel group).
    """

    layer_key: str
    module: SketchedColumnParallelLinear | SketchedRowParallelLinear
    parallel_kind: str
    in_features: int
    col_start: int
    col_end: int
    expert: bool = False

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.module.weight

    @property
    def rows(self) -> int:
        return self.module.weight.shape[0]

    @property
    def stride(self) -> int:
        """Interleaved row blocks of the shard (2 for a gated fc1: [gate_t; up_t])."""
        if self.parallel_kind == "row":
            return 1
        return int(getattr(self.module.weight, "partition_stride", 1))

    @property
    def tp_partial(self) -> bool:
        """Row-parallel sketches are partial sums over the tensor-parallel group."""
        return self.parallel_kind == "row"


def find_targets(
    model_chunks: Sequence[torch.nn.Module], target_names: Sequence[str], *, tp_rank: int
) -> list[SketchTarget]:
    """Every requested linear of every decoder layer in ``model_chunks``, in layer order."""
    targets: list[SketchTarget] = []
    for chunk in model_chunks:
        decoder = getattr(unwrap_model(chunk), "decoder", None)
        if decoder is None:
            raise TypeError("LoGRA targets live in a GPTModel's decoder; this chunk has none")
        for layer in decoder.layers:
            global_index = layer.layer_number - 1
            check_supported_layer(layer, global_index)
            for name in target_names:
                _, kind = TARGET_PATHS[name]
                for key, path, module, expert in _target_modules(layer, name, global_index):
                    targets.append(_target(key, path, module, kind, expert, global_index,
                                           tp_rank))
    return targets


def _target_modules(
    layer: torch.nn.Module, name: str, global_index: int
) -> list[tuple[str, str, torch.nn.Module, bool]]:
    """``(layer key, path, module, expert)`` of target ``name`` in one decoder layer: the layer's
    own linear, or in an MoE layer each routed expert's (keyed by its global index) and the
    shared expert's."""
    path, _ = TARGET_PATHS[name]
    prefix = f"decoder.layers.{global_index}"
    moe = moe_layers(layer)
    if moe is None or not path.startswith("mlp."):
        module: torch.nn.Module = layer
        for attr in path.split("."):
            module = getattr(module, attr)
        return [(f"{prefix}.{path}", path, module, False)]
    linear = path.removeprefix("mlp.")
    offset = expert_index_offset(moe.experts)
    found = [
        (f"{prefix}.mlp.experts.{offset + i}.{linear}",
         f"mlp.experts.local_experts.{i}.{linear}", getattr(expert, linear), True)
        for i, expert in enumerate(moe.experts.local_experts)
    ]
    if getattr(moe, "shared_experts", None) is not None:
        found.append((f"{prefix}.mlp.shared_experts.{linear}", f"mlp.shared_experts.{linear}",
                      getattr(moe.shared_experts, linear), False))
    return found


def _target(key: str, path: str, module: torch.nn.Module, kind: str, expert: bool,
            global_index: int, tp_rank: int) -> SketchTarget:
    expected = SketchedColumnParallelLinear if kind == "column" else SketchedRowParallelLinear
    if not isinstance(module, expected):
        raise TypeError(
            f"decoder.layers.{global_index}.{path} is a {type(module).__name__}, not "
            f"a {expected.__name__}: build the model with "
            "megatron_logra.mcore.models.gpt.gpt_layer_spec"
        )
    local_in = module.weight.shape[1]
    if kind == "column":
        in_features, col_start = local_in, 0
    else:
        in_features, col_start = module.input_size, tp_rank * local_in
    return SketchTarget(
        layer_key=key,
        module=module,
        parallel_kind=kind,
        in_features=in_features,
        col_start=col_start,
        col_end=col_start + local_in,
        expert=expert,
    )
