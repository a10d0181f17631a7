"""Model shapes and parallel layouts for the memory estimator (pure Python: no torch).

:class:`ModelShape` is a dense decoder-only transformer as far as memory is concerned (presets
for the Qwen2.5 family and a 27B dense shape, or derived from a run's ``model`` section);
:class:`Layout` a Megatron parallel layout with the per-step batch shape of one GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_logra.config import ATTENTIONS, NORMALIZATIONS, TARGET_NAMES

if TYPE_CHECKING:  # only for the annotation
    from megatron_logra.config import ModelConfig

GIB = 1024**3

TARGET_LINEARS: tuple[str, ...] = TARGET_NAMES
"""The linears of a transformer layer that LoRA adapts and LoGRA sketches."""

RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")
PRECISIONS: tuple[str, ...] = ("bf16", "fp32")
"""Dense Adam and LoRA: ``bf16`` is Megatron mixed precision (bf16 params and activations, fp32
grads and optimizer state); ``fp32`` keeps params and activations in fp32 (our CPU runs)."""
LOGRA_PRECISIONS: tuple[str, ...] = (
    "fp32", "bf16_sharded_master", "bf16_remainder", "bf16_host_master",
)
"""LoGRA's target weights: fp32 (their own masters), or bf16 with exact masters of each DP
rank's 1/dp share of rows (logra.master_weights): fp32 rows on the GPU (``dp_sharded``), int16
remainders on the GPU (``remainder``), fp32 rows in host memory (``host``)."""
LOGRA_PRECISION_OF_MASTER_WEIGHTS: dict[str, str] = {
    "none": "fp32", "dp_sharded": "bf16_sharded_master", "remainder": "bf16_remainder",
    "host": "bf16_host_master",
}
"""The estimate of each (resolved) ``logra.master_weights``."""
LOGRA_MASTER_GPU_BYTES: dict[str, int] = {
    "fp32": 0, "bf16_sharded_master": 4, "bf16_remainder": 2, "bf16_host_master": 0,
}
"""GPU bytes of master per owned target element (fp32 weights are their own masters)."""
NON_TARGET_TRAINING: tuple[str, ...] = ("adam", "frozen")
"""LoGRA's non-target parameters: trained by Megatron's Adam (``library`` mode) or frozen (the
paper's mode)."""

# Element sizes that do not follow the training precision.
DROPOUT_MASK_BYTES = 1  # a bool/uint8 mask per element (Korthikanti et al. 2022)
TOKEN_ID_BYTES = 8  # int64 token ids
FP32_BYTES = 4  # gradients, Adam state, masters, sketches, projections, cross-entropy softmax
BF16_BYTES = 2


def adam_bytes(params: float, precision: str, distributed_optimizer: bool,
                dp: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) of ``params`` trained by Megatron's Adam."""
    shard = dp if distributed_optimizer else 1
    if precision == "bf16":
        # bf16 param, fp32 main_grad, fp32 master + m + v (Megatron: 18, or 6 + 12/dp).
        return BF16_BYTES * params, FP32_BYTES * params, 3 * FP32_BYTES * params / shard
    # fp32 params are their own masters: fp32 grad, m + v.
    return FP32_BYTES * params, FP32_BYTES * params, 2 * FP32_BYTES * params / shard


def check_positive_int(argument: str, value: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{argument}={value!r} must be a positive integer; {fix}")


def check_choice(argument: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{argument}={value!r} is not valid; choose one of {list(choices)}")


# ----------------------------------------------------------------------------- model shape


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """The mixture-of-experts part of a GPT as our trainer builds it (``mcore/models/moe.py``):
    every ``layer_freq``-th layer (0, k, 2k, ...) replaces its dense MLP by a router of
    ``num_experts`` experts, ``topk`` per token, each an MLP of width
    ``expert_ffn_hidden_size``, plus an optional shared expert every token passes."""

    num_experts: int
    topk: int
    expert_ffn_hidden_size: int
    shared_expert_ffn_hidden_size: int = 0
    """0: no shared expert."""
    layer_freq: int = 1
    router_pre_softmax: bool = False
    """A softmax over all experts before the top k (``model.moe_router_pre_softmax``)."""
    shared_expert_gate: bool = False
    """The shared expert's sigmoid gate (``model.moe_shared_expert_gate``)."""

    def __post_init__(self) -> None:
        for argument in ("num_experts", "topk", "expert_ffn_hidden_size", "layer_freq"):
            check_positive_int(f"MoESpec.{argument}", getattr(self, argument),
                               "give the model's MoE size")
        if self.shared_expert_ffn_hidden_size < 0:
            raise ValueError(f"MoESpec.shared_expert_ffn_hidden_size="
                             f"{self.shared_expert_ffn_hidden_size} must be >= 0 (0: none)")
        if self.topk > self.num_experts:
            raise ValueError(f"MoESpec.topk={self.topk} exceeds MoESpec.num_experts="
                             f"{self.num_experts}")

    def is_moe_layer(self, index: int) -> bool:
        return index % self.layer_freq == 0

    def moe_layers(self, num_layers: int) -> int:
        return sum(self.is_moe_layer(i) for i in range(num_layers))


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A dense decoder-only transformer, as far as memory is concerned.

    ``vocab_size`` is padded at estimate time to a multiple of ``make_vocab_size_divisible_by * tp``
    as Megatron's training arguments do (use 1 for a vocabulary that is already padded).
    """

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    make_vocab_size_divisible_by: int = 128
    tied_embeddings: bool = False
    gated_mlp: bool = True
    """fc1 produces gate and up halves (SwiGLU / GeGLU): its output width is 2F."""
    qkv_bias: bool = False
    linear_bias: bool = False
    """Biases on all four linears (Megatron's add_bias_linear)."""
    normalization: str = "RMSNorm"
    norms_per_layer: int = 2
    """Norms over the hidden width per layer: 2 pre-norms, 4 with post-norms too (Gemma 3)."""
    qk_norm: bool = False
    """Per-head norms on queries and keys (weights of head_dim each)."""
    learned_positions: int = 0
    """Rows of a learned absolute position embedding (0 for rotary embeddings)."""
    dropout: bool = False
    """Hidden/attention dropout active in training (its masks are saved for backward)."""
    moe: MoESpec | None = None
    """Routed experts (:mod:`.moe_layer` counts what an MoE layer holds); None: dense."""

    def __post_init__(self) -> None:
        for argument in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                         "num_query_groups", "head_dim", "vocab_size",
                         "make_vocab_size_divisible_by"):
            check_positive_int(f"ModelShape.{argument}", getattr(self, argument), "give the model's size")
        check_choice("ModelShape.normalization", self.normalization, NORMALIZATIONS)
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"ModelShape.num_attention_heads={self.num_attention_heads} must be a multiple "
                f"of ModelShape.num_query_groups={self.num_query_groups}"
            )
        if self.norms_per_layer < 2:
            raise ValueError(
                f"ModelShape.norms_per_layer={self.norms_per_layer} must be at least 2 "
                "(the pre-attention and pre-MLP norms)"
            )
        if self.moe is not None and self.linear_bias:
            raise ValueError(
                "ModelShape.linear_bias=True with experts: expert biases are not modelled; "
                "estimate the model with linear_bias=False (Megatron keeps expert biases only "
                "at expert-TP 1)")
        if self.learned_positions < 0:
            raise ValueError(
                f"ModelShape.learned_positions={self.learned_positions} must be >= 0 "
                "(0 for rotary position embeddings)"
            )

    @property
    def query_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_query_groups * self.head_dim

    @property
    def fc1_width(self) -> int:
        return self.ffn_hidden_size * (2 if self.gated_mlp else 1)

    def padded_vocab_size(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return math.ceil(self.vocab_size / multiple) * multiple

    def targets(self) -> tuple[TargetLinear, ...]:
        """The four target linears of one dense layer, with global ``[out, in]`` shapes."""
        h = self.hidden_size
        return (
            TargetLinear("linear_qkv", self.query_width + 2 * self.kv_width, h, "column"),
            TargetLinear("linear_proj", h, self.query_width, "row"),
            *self.mlp_targets(self.ffn_hidden_size),
        )

    def mlp_targets(self, width: int) -> tuple[TargetLinear, TargetLinear]:
        """fc1 and fc2 of an MLP of FFN ``width`` (a dense layer's, an expert's)."""
        fc1 = width * (2 if self.gated_mlp else 1)
        return (TargetLinear("linear_fc1", fc1, self.hidden_size, "column"),
                TargetLinear("linear_fc2", self.hidden_size, width, "row"))

    def layer_kinds(self) -> tuple[tuple[bool, int], ...]:
        """``(is_moe, count)`` of the decoder layers (dense ones first)."""
        moe = self.moe.moe_layers(self.num_layers) if self.moe is not None else 0
        return tuple((kind, n) for kind, n in ((False, self.num_layers - moe), (True, moe))
                     if n)

    def layer_targets(self, is_moe: bool) -> tuple[TargetLinear, ...]:
        """The non-expert target linears of a layer of that kind: an MoE layer keeps its
        attention's and its shared expert's (if any); its routed experts are counted apart
        (:mod:`.experts`)."""
        if not is_moe:
            return self.targets()
        attention = self.targets()[:2]
        shared = self.moe.shared_expert_ffn_hidden_size
        return attention + (self.mlp_targets(shared) if shared else ())

    def router_params(self) -> int:
        """An MoE layer's router weight ``[experts, h]``, replicated on every rank."""
        return self.moe.num_experts * self.hidden_size if self.moe is not None else 0

    def norm_params_per_layer(self) -> int:
        per_norm = 2 if self.normalization == "LayerNorm" else 1  # weight (+ bias)
        params = self.norms_per_layer * self.hidden_size * per_norm
        if self.qk_norm:
            params += 2 * self.head_dim * per_norm
        return params

    def total_parameters(self) -> int:
        """Parameters of the whole model (one copy of tied embeddings), vocabulary padded for
        tp = 1."""
        layers = 0
        for is_moe, count in self.layer_kinds():
            layer = sum(t.out_features * t.in_features for t in self.layer_targets(is_moe))
            layer += self.norm_params_per_layer() + bias_params(self, tp=1)
            if is_moe:
                experts = self.mlp_targets(self.moe.expert_ffn_hidden_size)
                layer += self.router_params() + self.moe.num_experts * sum(
                    t.out_features * t.in_features for t in experts)
            layers += count * layer
        embedding = self.padded_vocab_size(1) * self.hidden_size
        final_norm = self.hidden_size * (2 if self.normalization == "LayerNorm" else 1)
        return (layers + embedding * (1 if self.tied_embeddings else 2)
                + final_norm + self.learned_positions * self.hidden_size)


@dataclass(frozen=True)
class TargetLinear:
    """One target linear: global ``W [out_features, in_features]`` and how TP splits it.

    Column-parallel shards hold ``out/tp`` rows and the full input; row-parallel shards hold all
    rows and ``in/tp`` input columns.
    """

    name: str
    out_features: int
    in_features: int
    parallel: str  # "column" or "row"

    def local_rows(self, tp: int) -> int:
        return self.out_features // tp if self.parallel == "column" else self.out_features

    def local_cols(self, tp: int) -> int:
        return self.in_features if self.parallel == "column" else self.in_features // tp


def bias_params(shape: ModelShape, tp: int) -> int:
    """Bias parameters of one layer on one TP rank (column biases split, row biases replicated)."""
    params = 0
    if shape.qkv_bias or shape.linear_bias:
        params += (shape.query_width + 2 * shape.kv_width) // tp
    if shape.linear_bias:
        params += shape.hidden_size + shape.fc1_width // tp + shape.hidden_size
    return params


def shape_from_model_config(model: ModelConfig, *, vocab_size: int, name: str = "config") -> ModelShape:
    """The shape of the GPT our trainer builds from ``model`` (see ``mcore/models/gpt.py``).

    ``vocab_size`` is the tokenizer's; it is padded here to ``model.make_vocab_size_divisible_by``
    the way our model pads it (independent of TP), so the shape carries no further padding.
    """
    check_positive_int("vocab_size", vocab_size, "pass the tokenizer's vocabulary size")
    moe = None
    if model.num_moe_experts is not None:
        from megatron_logra.config.moe import expert_ffn_width

        moe = MoESpec(num_experts=model.num_moe_experts, topk=model.moe_router_topk,
                      expert_ffn_hidden_size=expert_ffn_width(model),
                      shared_expert_ffn_hidden_size=model.moe_shared_expert_ffn_hidden_size or 0,
                      layer_freq=model.moe_layer_freq,
                      router_pre_softmax=model.moe_router_pre_softmax,
                      shared_expert_gate=model.moe_shared_expert_gate)
    padded = math.ceil(vocab_size / model.make_vocab_size_divisible_by)
    padded *= model.make_vocab_size_divisible_by
    return ModelShape(
        name=name,
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        # Megatron's default kv_channels, which our transformer config does not override.
        head_dim=model.hidden_size // model.num_attention_heads,
        vocab_size=padded,
        make_vocab_size_divisible_by=1,
        tied_embeddings=not model.untie_embeddings,
        gated_mlp=model.activation == "swiglu",
        qkv_bias=model.add_qkv_bias,
        linear_bias=model.add_bias_linear,
        normalization=model.normalization,
        qk_norm=model.qk_layernorm,
        learned_positions=model.seq_length if model.position_embedding == "learned_absolute" else 0,
        # Our transformer config sets hidden_dropout = attention_dropout = 0.
        dropout=False,
        moe=moe,
    )


PRESETS: dict[str, ModelShape] = {
    # Public Qwen2.5-1.5B config (Qwen2.5-Math-1.5B has the same shape): tied embeddings, bias on
    # q/k/v only, SwiGLU, RMSNorm, rotary positions, no dropout.
    "qwen2.5-1.5b": ModelShape(
        name="qwen2.5-1.5b", num_layers=28, hidden_size=1536, ffn_hidden_size=8960,
        num_attention_heads=12, num_query_groups=2, head_dim=128, vocab_size=151936,
        tied_embeddings=True, gated_mlp=True, qkv_bias=True,
    ),
    # Public Qwen2.5-7B config (as Qwen2.5-Math-7B): untied embeddings, otherwise as above.
    "qwen2.5-7b": ModelShape(
        name="qwen2.5-7b", num_layers=28, hidden_size=3584, ffn_hidden_size=18944,
        num_attention_heads=28, num_query_groups=4, head_dim=128, vocab_size=152064,
        tied_embeddings=False, gated_mlp=True, qkv_bias=True,
    ),
    # The text decoder of the public Gemma 3 27B config: 62 layers, hidden 5376, 32 query heads
    # in 16 groups of width 128 (query width 4096, not the hidden size), gated-GeLU MLP of 21504,
    # vocabulary 262208, tied embeddings, pre- and post-norms around attention and MLP (4 per
    # layer), q/k norms, no biases. Its sliding-window layers are treated as full attention (this
    # matters only for the unfused attention scores of recompute="none").
    "gemma3-27b": ModelShape(
        name="gemma3-27b", num_layers=62, hidden_size=5376, ffn_hidden_size=21504,
        num_attention_heads=32, num_query_groups=16, head_dim=128, vocab_size=262208,
        tied_embeddings=True, gated_mlp=True, norms_per_layer=4, qk_norm=True,
    ),
}


def preset(name: str) -> ModelShape:
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is unknown; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A Megatron parallel layout and the per-step batch shape of one GPU."""

    tp: int = 1
    cp: int = 1
    """Context parallelism (``parallel.cp``): each sequence split over ``cp`` ranks, which hold
    the same weights; gradients are reduced and Adam state and LoGRA masters sharded over the
    ``dp * cp`` ranks (Megatron's data-parallel group with context parallelism)."""
    cpu: bool = False
    """The run is on the CPU (``parallel.device=cpu``, where the estimate is checked): its
    context-parallel attention keeps additive bottom-right masks that CUDA's kernels apply
    without materialising them (:func:`megatron_logra.memory.built_layer.cp_mask_bytes`)."""
    pp: int = 1
    vpp: int | None = None
    """Virtual pipeline stages per pipeline rank (interleaved 1F1B); None for plain 1F1B."""
    dp: int = 1
    ep: int = 1
    """Expert parallelism (``parallel.ep``): routed experts split over ``ep`` of the DP ranks;
    their gradients and optimizer state reduced and sharded over the ``dp / ep`` expert-DP
    ranks (expert TP = tp, Megatron's default)."""
    micro_batch_size: int = 1
    seq_length: int = 2048
    sequence_parallel: bool = False
    recompute: str = "selective"
    """``none``: everything saved, attention scores included (unfused attention, as in
    Korthikanti et al.'s model); ``selective``: core attention recomputed (Megatron's default
    selective recompute), its q/k/v inputs saved; ``full``: each layer saves only its input and
    is recomputed, one layer at a time, in backward."""
    num_microbatches: int | None = None
    """Microbatches per step and pipeline; None means "at least pp" (no discount), as Megatron's
    formula does when it is not given the number."""
    attention: str | None = None
    """The model our trainer builds (``model.attention``: ``sdpa``, ``local`` or ``te``), whose
    layers keep what :mod:`.activations` counts for that implementation (unfused SwiGLU gate,
    the trainable norms' inputs, the attention kernel's own saved tensors); None: Korthikanti et
    al.'s accounting of a fused Megatron-LM layer (what Megatron's formula assumes)."""
    recompute_num_layers: int = 1
    """``recompute=full``: layers per checkpointed group (``model.recompute_num_layers``, uniform
    method): one input is kept per group and a whole group is rebuilt at a time."""

    def __post_init__(self) -> None:
        fixes = {"tp": "use 1 for no tensor parallelism", "cp": "use 1 for no context parallelism",
                 "pp": "use 1 for no pipeline",
                 "dp": "use 1 for no data parallelism", "ep": "use 1 for no expert parallelism", "micro_batch_size": "use 1 or more",
                 "seq_length": "give the sequence length in tokens"}
        for argument, fix in fixes.items():
            check_positive_int(f"Layout.{argument}", getattr(self, argument), fix)
        check_choice("Layout.recompute", self.recompute, RECOMPUTE_MODES)
        if self.attention is not None:
            check_choice("Layout.attention", self.attention, ATTENTIONS)
        check_positive_int("Layout.recompute_num_layers", self.recompute_num_layers,
                           "use 1 to checkpoint every layer")
        if self.vpp is not None:
            check_positive_int("Layout.vpp", self.vpp, "use None for the non-interleaved schedule")
            if self.pp < 2:
                raise ValueError(
                    f"Layout.vpp={self.vpp} needs Layout.pp >= 2 (got pp={self.pp}); set vpp=None"
                )
        if self.num_microbatches is not None:
            check_positive_int("Layout.num_microbatches", self.num_microbatches,
                      "use None when the number is not known")
        if self.dp % self.ep:
            raise ValueError(f"Layout.ep={self.ep} must divide Layout.dp={self.dp} (expert "
                             "parallel ranks are carved out of the data-parallel ones)")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "Layout.sequence_parallel=True needs Layout.tp > 1; set sequence_parallel=False"
            )
        if self.sequence_parallel and self.seq_length % self.tp:
            raise ValueError(
                f"Layout.seq_length={self.seq_length} must be divisible by Layout.tp={self.tp} "
                "under sequence parallelism"
            )
        if self.cp > 1:
            multiple = 2 * self.cp * (self.tp if self.sequence_parallel else 1)
            if self.seq_length % multiple:
                raise ValueError(
                    f"Layout.seq_length={self.seq_length} must be a multiple of {multiple} (2 * cp"
                    f"{' * tp' if self.sequence_parallel else ''}): each sequence is split into "
                    "2 * cp chunks"
                )
            if self.attention == "local":
                raise ValueError("Layout.attention='local' refuses context parallelism (as "
                                 "Megatron's DotProductAttention does); use 'sdpa' or 'te'")

    @property
    def expert_dp(self) -> int:
        """Ranks of one expert-data-parallel group (``tp * dp / (expert_tp * ep)``)."""
        return self.dp // self.ep

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same weights: gradients are reduced, and the distributed Adam
        state and LoGRA's masters sharded, over them."""
        return self.dp * self.cp

    @property
    def local_seq_length(self) -> int:
        """Positions of each sequence on one rank (its two chunks under CP)."""
        return self.seq_length // self.cp

    @property
    def tokens(self) -> int:
        """T: tokens of one microbatch on one rank (its CP share)."""
        return self.local_seq_length * self.micro_batch_size

    @property
    def sharded_tokens(self) -> float:
        """T_s: tokens of one microbatch that one TP rank holds outside the TP-split regions."""
        return self.tokens / self.tp if self.sequence_parallel else float(self.tokens)

    def in_flight_microbatches(self) -> float:
        """Microbatches whose activations the first pipeline stage holds at its peak.

        Megatron's formula: 1 without a pipeline; ``min(pp, num_microbatches)`` for 1F1B; and
        ``pp * (1 + (pp - 1) / (pp * vpp))`` for the interleaved schedule (a fractional count:
        the penalty factor applied to ``pp`` microbatches of ``L / pp`` layers).
        """
        if self.pp == 1:
            return 1.0
        if self.vpp is not None:
            return self.pp * (1 + (self.pp - 1) / (self.pp * self.vpp))
        if self.num_microbatches is None:
            return float(self.pp)
        return float(min(self.pp, self.num_microbatches))

    def check_fits(self, shape: ModelShape) -> None:
        """Raise ValueError when ``shape`` cannot be split this way."""
        for argument, value in (("num_attention_heads", shape.num_attention_heads),
                                ("num_query_groups", shape.num_query_groups),
                                ("ffn_hidden_size", shape.ffn_hidden_size)):
            if value % self.tp:
                raise ValueError(
                    f"{shape.name}: {argument}={value} is not divisible by tp={self.tp}; "
                    "choose a tp that divides it"
                )
        if shape.moe is not None:
            self._check_fits_moe(shape)
        chunks = self.pp * (self.vpp or 1)
        if shape.num_layers % chunks:
            raise ValueError(
                f"{shape.name}: num_layers={shape.num_layers} is not divisible by pp * vpp = "
                f"{chunks}; choose pp (and vpp) that divide the layer count"
            )

    def _check_fits_moe(self, shape: ModelShape) -> None:
        moe = shape.moe
        if moe.num_experts % self.ep:
            raise ValueError(f"{shape.name}: num_experts={moe.num_experts} is not divisible by "
                             f"ep={self.ep}; choose an ep that divides it")
        for argument, value in (("expert_ffn_hidden_size", moe.expert_ffn_hidden_size),
                                ("shared_expert_ffn_hidden_size",
                                 moe.shared_expert_ffn_hidden_size)):
            if value % self.tp:
                raise ValueError(f"{shape.name}: {argument}={value} is not divisible by "
                                 f"expert tp = tp = {self.tp}; choose a tp that divides it")
        if self.pp > 1:
            raise ValueError(f"{shape.name} has experts and Layout.pp={self.pp}: pipeline "
                             "stages with experts are not modelled by the estimate; use pp=1")
