"""The routed experts' persistent state on one GPU (pure Python: no torch).

The rest of the estimator describes dense layers and still refuses an MoE config as a whole
(:func:`megatron_logra.memory.shapes.shape_from_model_config`): the router's dispatch buffers and
the experts' saved activations are not modelled yet. What this module counts is the part that
decides whether an MoE model's optimizer fits at all -- the experts hold most of its weights
(Qwen3-30B-A3B: ~29 of 30.5 B) -- with the same element sizes as the dense estimate
(:mod:`megatron_logra.memory.estimate`), per GPU:

* experts are split over ``ep`` ranks (``num_experts / ep`` local experts) and each expert's
  fc1 column-parallel / fc2 row-parallel over ``expert_tp`` (Megatron's default: equal to TP);
* their gradients and optimizer state are reduced and sharded over the expert-data-parallel
  group of ``expert_dp`` ranks (``tp * dp / (expert_tp * ep)``), not the dense DP group;
* LoGRA gives every expert linear its own projection ``[r, n_local]`` and sketch
  ``[m_local, r]`` (keyed by the expert's global index) and one RowAdam moment per row; the
  built fp32 mode replicates the moments over expert-DP (docs/moe.md).

The shared expert sees every token and is replicated over EP: it is a dense MLP as far as memory
is concerned, not counted here.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_logra.memory.shapes import (
    BF16_BYTES,
    FP32_BYTES,
    PRECISIONS,
    TargetLinear,
    adam_bytes,
    check_choice,
    check_positive_int,
)

EXPERT_METHODS: tuple[str, ...] = ("dense_adam", "lora", "logra")
EXPERT_LOGRA_PRECISIONS: tuple[str, ...] = ("fp32", "bf16_sharded_master")
"""``fp32`` is what is built for MoE; ``bf16_sharded_master`` (bf16 experts, fp32 masters and
moments sharded over expert-DP) is refused for MoE today and estimated to say what it would
save."""
CATEGORIES: tuple[str, ...] = ("weights", "gradients", "optimizer_state", "sketches",
                               "projections")


@dataclass(frozen=True, kw_only=True)
class ExpertShape:
    """The routed experts of an MoE GPT."""

    name: str
    moe_layers: int
    """Decoder layers with routed experts."""
    hidden_size: int
    num_experts: int
    expert_ffn_hidden_size: int
    gated_mlp: bool = True

    def __post_init__(self) -> None:
        for argument in ("moe_layers", "hidden_size", "num_experts", "expert_ffn_hidden_size"):
            check_positive_int(f"ExpertShape.{argument}", getattr(self, argument),
                               "give the model's size")

    def linears(self) -> tuple[TargetLinear, TargetLinear]:
        """One expert's fc1 and fc2, global ``[out, in]``."""
        fc1_out = self.expert_ffn_hidden_size * (2 if self.gated_mlp else 1)
        return (TargetLinear("linear_fc1", fc1_out, self.hidden_size, "column"),
                TargetLinear("linear_fc2", self.hidden_size, self.expert_ffn_hidden_size, "row"))

    def total_parameters(self) -> int:
        per_expert = sum(t.out_features * t.in_features for t in self.linears())
        return self.moe_layers * self.num_experts * per_expert


def expert_shape_from_model_config(model, name: str = "config") -> ExpertShape:
    """The routed experts our trainer builds from ``model`` (``mcore/models/moe.py``)."""
    from megatron_logra.config.moe import expert_ffn_width, is_moe_layer

    if model.num_moe_experts is None:
        raise ValueError("model.num_moe_experts is unset: the model has no routed experts")
    return ExpertShape(
        name=name,
        moe_layers=sum(is_moe_layer(model, i) for i in range(model.num_layers)),
        hidden_size=model.hidden_size, num_experts=model.num_moe_experts,
        expert_ffn_hidden_size=expert_ffn_width(model), gated_mlp=model.activation == "swiglu",
    )


def expert_shape_of(shape) -> ExpertShape:
    """The routed experts of a :class:`~megatron_logra.memory.shapes.ModelShape` with
    ``moe`` set."""
    moe = shape.moe
    return ExpertShape(name=shape.name, moe_layers=moe.moe_layers(shape.num_layers),
                       hidden_size=shape.hidden_size, num_experts=moe.num_experts,
                       expert_ffn_hidden_size=moe.expert_ffn_hidden_size,
                       gated_mlp=shape.gated_mlp)


# Megatron-scale presets: the routed experts of a public config.
EXPERT_PRESETS: dict[str, ExpertShape] = {
    # Qwen3-30B-A3B: 48 layers, all MoE, hidden 2048, 128 experts of width 768 (top-8), SwiGLU.
    "qwen3-30b-a3b": ExpertShape(name="qwen3-30b-a3b", moe_layers=48, hidden_size=2048,
                                 num_experts=128, expert_ffn_hidden_size=768),
}


def _check_split(shape: ExpertShape, ep: int, expert_tp: int, expert_dp: int) -> None:
    for argument, value in (("ep", ep), ("expert_tp", expert_tp), ("expert_dp", expert_dp)):
        check_positive_int(argument, value, "use 1 for no split")
    if shape.num_experts % ep:
        raise ValueError(f"ep={ep} must divide {shape.name}'s num_experts={shape.num_experts}; "
                         "choose an ep that divides it")
    if shape.expert_ffn_hidden_size % expert_tp:
        raise ValueError(f"expert_tp={expert_tp} must divide {shape.name}'s "
                         f"expert_ffn_hidden_size={shape.expert_ffn_hidden_size}")


def expert_state_bytes(
    shape: ExpertShape, *, method: str, ep: int = 1, expert_tp: int = 1, expert_dp: int = 1,
    precision: str = "bf16", sketch_rank: int = 256, lora_rank: int = 16,
    distributed_optimizer: bool = True,
) -> dict[str, float]:
    """Bytes of the routed experts on one GPU, by category (:data:`CATEGORIES`).

    ``precision``: for ``dense_adam`` and ``lora`` one of PRECISIONS (as the dense estimate);
    for ``logra`` one of EXPERT_LOGRA_PRECISIONS.
    """
    check_choice("method", method, EXPERT_METHODS)
    _check_split(shape, ep, expert_tp, expert_dp)
    local = shape.moe_layers * shape.num_experts // ep  # expert linears pairs on the rank
    params = local * sum(t.local_rows(expert_tp) * t.local_cols(expert_tp)
                         for t in shape.linears())
    rows = local * sum(t.local_rows(expert_tp) for t in shape.linears())
    cols = local * sum(t.local_cols(expert_tp) for t in shape.linears())
    out = dict.fromkeys(CATEGORIES, 0.0)
    if method == "dense_adam":
        check_choice("precision", precision, PRECISIONS)
        out["weights"], out["gradients"], out["optimizer_state"] = adam_bytes(
            params, precision, distributed_optimizer, expert_dp)
    elif method == "lora":
        check_choice("precision", precision, PRECISIONS)
        check_positive_int("lora_rank", lora_rank, "use the LoRA rank, e.g. 16")
        adapters = lora_rank * (rows + cols)
        weights, out["gradients"], out["optimizer_state"] = adam_bytes(
            adapters, precision, distributed_optimizer, expert_dp)
        base = BF16_BYTES if precision == "bf16" else FP32_BYTES
        out["weights"] = base * params + weights
    else:
        check_choice("precision", precision, EXPERT_LOGRA_PRECISIONS)
        check_positive_int("sketch_rank", sketch_rank, "use the sketch rank, e.g. 256")
        sharded = precision == "bf16_sharded_master"
        e = BF16_BYTES if sharded else FP32_BYTES
        shard = expert_dp if sharded else 1
        out["weights"] = e * params
        # fp32 master shard (bf16 mode only) and the RowAdam second moment, one per row.
        out["optimizer_state"] = (FP32_BYTES * params if sharded else 0.0) / shard
        out["optimizer_state"] += FP32_BYTES * rows / shard
        out["sketches"] = FP32_BYTES * rows * sketch_rank  # accumulated before any reduction
        out["projections"] = e * sketch_rank * cols  # every expert its own A
    return out
