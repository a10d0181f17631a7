"""Analytic per-GPU training memory of dense Adam, LoRA and LoGRA on a Megatron-Core layout.

Everything is counted in bytes on one GPU of the first pipeline stage, the stage Megatron's own
theoretical-memory formula reports: it holds the embedding and, under a pipeline schedule, the
most microbatches in flight. (With pp > 1 the last stage holds the output layer and the
cross-entropy logits instead; for a very large vocabulary it can be the fuller one, which this
estimate, like Megatron's, does not report.)

Five persistent categories, the same ones :mod:`megatron_logra.mcore.training.state_bytes` measures, plus
the saved activations of one step:

* ``weights``: the model's parameters in their storage dtype (LoRA: base + adapters).
* ``gradients``: fp32 gradient buffers (Megatron DDP's ``main_grad``) of what Adam trains.
* ``optimizer_state``: Adam's m and v, fp32 master copies, LoGRA's fp32 masters and row moments.
* ``sketches``: LoGRA's fp32 ``[m_local, r]`` sketch of every target.
* ``projections``: LoGRA's fp32 ``[r, n_local]`` projection of every target (regenerated from a
  seed after each update and cached for the step).
* ``activations``: tensors saved for backward, per Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models", section 4 and Table 2), generalised to grouped-query
  attention, separate head width, gated MLPs and dropout-free models, and multiplied by the
  microbatches in flight exactly as Megatron-LM's theoretical-memory formula does.

Not modelled (each is small or transient): torch Adam's 4-byte step counter per parameter
tensor, DDP grad-buffer alignment padding, communication buffers, allocator fragmentation, the
CUDA context, and temporaries of the optimizer step (e.g. LoGRA's ``D A`` product per target).

Bytes per parameter, by method and precision (``dp`` = data-parallel size; ``/dp`` only with
Megatron's distributed optimizer, or for LoGRA's sharded masters):

=========================  =======  =====  ==========================================
what                       weights  grads  optimizer state
=========================  =======  =====  ==========================================
dense Adam, bf16           2        4      12 (fp32 master + m + v), or 12/dp
dense Adam, fp32           4        4      8 (m + v; the params are the masters), or 8/dp
LoRA base (frozen)         2 or 4   --     --
LoRA adapters              like dense Adam in the same precision
LoGRA target, fp32         4        --     --
LoGRA target, bf16 shard   2        --     4/dp (fp32 master shard)
LoGRA non-target           like dense Adam ("library" mode), or weights only ("frozen")
=========================  =======  =====  ==========================================

plus, per LoGRA target with ``m_local`` rows and ``n_local`` input columns on the rank: a row
moment of 4 bytes per row (4/dp when sharded), a sketch of ``4 m_local r`` and a projection of
``4 r n_local`` bytes. Saved activations: a sketched linear keeps ``X A^T`` (r wide) where the
dense one keeps its input X (n_local wide); a LoRA linear keeps X and ``X A^T`` of its adapter.

In ``bf16_sharded_master`` mode the sketch is reduce-scattered over data parallelism so that each
rank keeps masters and row moments only for its share of rows, but the full ``[m_local, r]`` sketch
is accumulated during backward, before that reduce-scatter: the peak holds all of it, and so does
this estimate.

Shape symbols: h hidden, F ffn hidden, a heads, g query groups, d head width, qd = a d (query
width), kvd = g d (key/value width), V padded vocabulary, L layers, t = tp, T = seq x micro-batch
tokens, T_s = T / t under sequence parallelism and T otherwise, r rank, e activation element bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for the annotation: the estimator itself needs neither torch nor Megatron
    from megatron_logra.config import ModelConfig

GIB = 1024**3

TARGET_LINEARS: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The linears of a transformer layer that LoRA adapts and LoGRA sketches (the same names as
``megatron_logra.config.TARGET_NAMES``; repeated here so that the estimator imports no torch)."""

NORMALIZATIONS: tuple[str, ...] = ("LayerNorm", "RMSNorm")
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")
PRECISIONS: tuple[str, ...] = ("bf16", "fp32")
"""Dense Adam and LoRA: ``bf16`` is Megatron mixed precision (bf16 params and activations, fp32
grads and optimizer state); ``fp32`` keeps params and activations in fp32 (our CPU runs)."""
LOGRA_PRECISIONS: tuple[str, ...] = ("fp32", "bf16_sharded_master")
NON_TARGET_TRAINING: tuple[str, ...] = ("adam", "frozen")
"""LoGRA's non-target parameters: trained by Megatron's Adam (``library`` mode) or frozen (the
paper's mode)."""

# Element sizes that do not follow the training precision.
DROPOUT_MASK_BYTES = 1  # a bool/uint8 mask per element (Korthikanti et al. 2022)
TOKEN_ID_BYTES = 8  # int64 token ids
FP32_BYTES = 4  # gradients, Adam state, masters, sketches, projections, cross-entropy softmax
BF16_BYTES = 2


def _positive(argument: str, value: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{argument}={value!r} must be a positive integer; {fix}")


def _choice(argument: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{argument}={value!r} is not valid; choose one of {list(choices)}")


# ----------------------------------------------------------------------------- model shape


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

    def __post_init__(self) -> None:
        for argument in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                         "num_query_groups", "head_dim", "vocab_size",
                         "make_vocab_size_divisible_by"):
            _positive(f"ModelShape.{argument}", getattr(self, argument), "give the model's size")
        _choice("ModelShape.normalization", self.normalization, NORMALIZATIONS)
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
        """The four target linears of one layer, with global ``[out, in]`` shapes."""
        h = self.hidden_size
        return (
            TargetLinear("linear_qkv", self.query_width + 2 * self.kv_width, h, "column"),
            TargetLinear("linear_proj", h, self.query_width, "row"),
            TargetLinear("linear_fc1", self.fc1_width, h, "column"),
            TargetLinear("linear_fc2", h, self.ffn_hidden_size, "row"),
        )

    def norm_params_per_layer(self) -> int:
        per_norm = 2 if self.normalization == "LayerNorm" else 1  # weight (+ bias)
        params = self.norms_per_layer * self.hidden_size * per_norm
        if self.qk_norm:
            params += 2 * self.head_dim * per_norm
        return params

    def total_parameters(self) -> int:
        """Parameters of the whole model (one copy of tied embeddings), vocabulary padded for
        tp = 1."""
        layer = sum(t.out_features * t.in_features for t in self.targets())
        layer += self.norm_params_per_layer() + _bias_params(self, tp=1)
        embedding = self.padded_vocab_size(1) * self.hidden_size
        final_norm = self.hidden_size * (2 if self.normalization == "LayerNorm" else 1)
        return (self.num_layers * layer + embedding * (1 if self.tied_embeddings else 2)
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


def _bias_params(shape: ModelShape, tp: int) -> int:
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
    _positive("vocab_size", vocab_size, "pass the tokenizer's vocabulary size")
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
        learned_positions=model.seq_length if model.position_embedding == "learned_absolute" else 0,
        # Our transformer config sets hidden_dropout = attention_dropout = 0.
        dropout=False,
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
    pp: int = 1
    vpp: int | None = None
    """Virtual pipeline stages per pipeline rank (interleaved 1F1B); None for plain 1F1B."""
    dp: int = 1
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

    def __post_init__(self) -> None:
        fixes = {"tp": "use 1 for no tensor parallelism", "pp": "use 1 for no pipeline",
                 "dp": "use 1 for no data parallelism", "micro_batch_size": "use 1 or more",
                 "seq_length": "give the sequence length in tokens"}
        for argument, fix in fixes.items():
            _positive(f"Layout.{argument}", getattr(self, argument), fix)
        _choice("Layout.recompute", self.recompute, RECOMPUTE_MODES)
        if self.vpp is not None:
            _positive("Layout.vpp", self.vpp, "use None for the non-interleaved schedule")
            if self.pp < 2:
                raise ValueError(
                    f"Layout.vpp={self.vpp} needs Layout.pp >= 2 (got pp={self.pp}); set vpp=None"
                )
        if self.num_microbatches is not None:
            _positive("Layout.num_microbatches", self.num_microbatches,
                      "use None when the number is not known")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "Layout.sequence_parallel=True needs Layout.tp > 1; set sequence_parallel=False"
            )
        if self.sequence_parallel and self.seq_length % self.tp:
            raise ValueError(
                f"Layout.seq_length={self.seq_length} must be divisible by Layout.tp={self.tp} "
                "under sequence parallelism"
            )

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def tokens(self) -> int:
        """T: tokens of one microbatch."""
        return self.seq_length * self.micro_batch_size

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
        chunks = self.pp * (self.vpp or 1)
        if shape.num_layers % chunks:
            raise ValueError(
                f"{shape.name}: num_layers={shape.num_layers} is not divisible by pp * vpp = "
                f"{chunks}; choose pp (and vpp) that divide the layer count"
            )


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU of the first pipeline stage, by category."""

    method: str
    precision: str
    weights: float
    gradients: float
    optimizer_state: float
    sketches: float
    projections: float
    activations: float

    CATEGORIES = ("weights", "gradients", "optimizer_state", "sketches", "projections",
                  "activations")

    @property
    def persistent(self) -> float:
        """State that lives between steps (everything but activations)."""
        return self.total - self.activations

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer_state + self.sketches
                + self.projections + self.activations)

    def as_dict(self) -> dict[str, float | str]:
        out: dict[str, float | str] = {"method": self.method, "precision": self.precision,
                                       "total_gib": self.total / GIB,
                                       "persistent_gib": self.persistent / GIB}
        for name in self.CATEGORIES:
            out[f"{name}_gib"] = getattr(self, name) / GIB
        for name in (*self.CATEGORIES, "persistent", "total"):
            out[f"{name}_bytes"] = round(getattr(self, name))
        return out


# ----------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class StageParameters:
    """Parameters on one GPU of the first pipeline stage.

    Attributes:
        targets: the target linears' weights (all four per layer, TP-local).
        non_targets: everything else: embeddings (and the output layer and final norm when
            pp = 1), norms, biases.
        layers: transformer layers on the stage.
    """

    targets: int
    non_targets: int
    layers: int


def stage_parameters(
    shape: ModelShape, layout: Layout, targets: tuple[str, ...] = TARGET_LINEARS
) -> StageParameters:
    """Exact per-rank parameter counts of the first stage (norms and row biases replicated)."""
    layout.check_fits(shape)
    tp = layout.tp
    layers = shape.num_layers // layout.pp
    target_params = 0
    other_linear_params = 0
    for target in shape.targets():
        params = target.local_rows(tp) * target.local_cols(tp)
        if target.name in targets:
            target_params += params
        else:
            other_linear_params += params
    per_layer_other = other_linear_params + shape.norm_params_per_layer() + _bias_params(shape, tp)
    embedding = shape.padded_vocab_size(tp) // tp * shape.hidden_size
    non_targets = layers * per_layer_other + embedding + shape.learned_positions * shape.hidden_size
    if layout.pp == 1:
        final_norm = shape.hidden_size * (2 if shape.normalization == "LayerNorm" else 1)
        non_targets += final_norm + (0 if shape.tied_embeddings else embedding)
    return StageParameters(targets=layers * target_params, non_targets=non_targets, layers=layers)


def _target_sums(shape: ModelShape, layout: Layout, targets: tuple[str, ...]) -> tuple[int, int]:
    """(sum of local rows, sum of local input columns) over the stage's target linears."""
    rows = cols = 0
    for target in shape.targets():
        if target.name in targets:
            rows += target.local_rows(layout.tp)
            cols += target.local_cols(layout.tp)
    layers = shape.num_layers // layout.pp
    return layers * rows, layers * cols


def lora_adapter_parameters(
    shape: ModelShape, layout: Layout, lora_rank: int, targets: tuple[str, ...] = TARGET_LINEARS
) -> int:
    """Adapter parameters on one GPU of the first stage.

    Each target gets ``A [r, n]`` and ``B [m, r]`` split like the layer's input and output:
    column-parallel layers keep the full A and ``m/tp`` rows of B; row-parallel layers keep the
    ``n/tp`` columns of A and the full B.
    """
    _positive("lora_rank", lora_rank, "use the LoRA rank, e.g. 256")
    per_layer = 0
    for target in shape.targets():
        if target.name in targets:
            per_layer += lora_rank * (target.local_cols(layout.tp) + target.local_rows(layout.tp))
    return (shape.num_layers // layout.pp) * per_layer


# ----------------------------------------------------------------------------- activations

LINEAR_MODES: tuple[str, ...] = ("dense", "frozen", "lora", "sketched")
"""What a linear saves for its weight gradient:

* ``dense``: its input X (local ``[T_s, n]`` for column-parallel -- re-gathered in backward under
  sequence parallelism -- and ``[T, n/tp]`` for row-parallel);
* ``frozen``: nothing (Megatron's frozen-weight path keeps only the weight);
* ``lora``: a frozen base (nothing) plus an adapter whose down-projection keeps X (the same
  tensor the dense layer would keep) and whose up-projection keeps ``X A^T [T_s, r]``;
* ``sketched``: ``P = X A^T`` instead of X: ``[T_s, r]`` column-parallel (projected from the
  local sequence shard), ``[T, r]`` row-parallel (projected from the local columns).
"""


def _linear_saved(
    mode: str, *, tokens: float, width: float, adapter_tokens: float, rank: int, e: int
) -> tuple[float, float]:
    """(bytes of the saved input X, bytes of the saved low-rank activation) for one linear."""
    _choice("linear mode", mode, LINEAR_MODES)
    saved_input = e * tokens * width if mode in ("dense", "lora") else 0.0
    if mode == "lora":
        return saved_input, e * adapter_tokens * rank
    if mode == "sketched":
        return 0.0, e * tokens * rank
    return saved_input, 0.0


def layer_activation_terms(
    shape: ModelShape,
    layout: Layout,
    *,
    element_bytes: int,
    linear_modes: Mapping[str, str],
    rank: int = 0,
    recompute: str | None = None,
) -> dict[str, float]:
    """Bytes one transformer layer saves for backward for one microbatch, term by term.

    Which terms a method changes: only the four ``<linear>_input`` terms, each saved *solely* for
    that linear's weight gradient (the norm outputs feeding qkv and fc1, the attention context
    feeding proj, the activation output feeding fc2: no other op keeps these tensors; the norms
    keep their *inputs*, the activation keeps its *input*, core attention keeps q/k/v, which are
    qkv's *outputs*). Those stay whatever the method: ``selective`` recompute still saves q/k/v
    and ``full`` recompute still saves each layer's input.

    With ``recompute="full"`` this returns the terms of the layer being recomputed (its complete
    forward, ``none``); the per-layer checkpoint is added by :func:`stage_activation_bytes`.
    """
    recompute = recompute or layout.recompute
    if recompute == "full":
        recompute = "none"
    e = element_bytes
    t = layout.tp
    T, T_s = float(layout.tokens), layout.sharded_tokens
    h, qd, kvd = shape.hidden_size, shape.query_width, shape.kv_width
    widths = {target.name: target.local_cols(t) for target in shape.targets()}
    # Column-parallel inputs are held per sequence shard, row-parallel inputs for all tokens.
    tokens = {"linear_qkv": T_s, "linear_proj": T, "linear_fc1": T_s, "linear_fc2": T}

    def linear(name: str) -> tuple[float, float]:
        return _linear_saved(linear_modes.get(name, "dense"), tokens=tokens[name],
                             width=widths[name], adapter_tokens=T_s, rank=rank, e=e)

    terms: dict[str, float] = {}
    terms["input_norm_input"] = e * T_s * h
    terms["linear_qkv_input"], terms["linear_qkv_lowrank"] = linear("linear_qkv")
    if shape.qk_norm:
        terms["qk_norm_inputs"] = e * T * (qd + kvd) / t
    if recompute == "none":
        # Unfused attention expands K and V to all heads before its two batched matmuls, which
        # keep Q, the expanded K and the expanded V.
        terms["core_attention_qkv"] = e * T * 3 * qd / t
        score_bytes = e + ((DROPOUT_MASK_BYTES + e) if shape.dropout else 0)
        heads = shape.num_attention_heads / t
        terms["attention_scores"] = (
            heads * layout.seq_length * layout.seq_length * layout.micro_batch_size * score_bytes
        )
    else:
        # Selective recompute keeps the inputs of the recomputed core attention: q, k, v.
        terms["core_attention_qkv"] = e * T * (qd + 2 * kvd) / t
    terms["linear_proj_input"], terms["linear_proj_lowrank"] = linear("linear_proj")
    if shape.norms_per_layer > 2:
        terms["post_norm_inputs"] = (shape.norms_per_layer - 2) * e * T_s * h
    if shape.dropout:
        terms["attention_dropout_mask"] = DROPOUT_MASK_BYTES * T_s * h
    terms["pre_mlp_norm_input"] = e * T_s * h
    terms["linear_fc1_input"], terms["linear_fc1_lowrank"] = linear("linear_fc1")
    # The activation (GeLU, or a fused SwiGLU/GeGLU kernel) keeps its input, fc1's output. The
    # unfused eager GLU would also keep its [T, F/t] gate activation; not counted.
    terms["activation_input"] = e * T * shape.fc1_width / t
    terms["linear_fc2_input"], terms["linear_fc2_lowrank"] = linear("linear_fc2")
    if shape.dropout:
        terms["mlp_dropout_mask"] = DROPOUT_MASK_BYTES * T_s * h
    return {name: value for name, value in terms.items() if value}


@dataclass(frozen=True)
class ActivationBreakdown:
    """Activation bytes of the first stage at its peak, split the way Megatron's formula adds."""

    per_layer: float
    """Saved per layer and microbatch (the checkpointed input under full recompute)."""
    layers: float
    """``per_layer * layers on the stage * microbatches in flight``."""
    embedding: float
    """Token ids and embedding dropout mask, times microbatches in flight."""
    recomputed_layer: float
    """Full recompute only: one layer's complete forward, rebuilt during its backward."""
    output: float
    """pp = 1 only: final norm input, output-layer input and the fp32 cross-entropy softmax."""

    @property
    def total(self) -> float:
        return self.layers + self.embedding + self.recomputed_layer + self.output


def stage_activation_bytes(
    shape: ModelShape,
    layout: Layout,
    *,
    element_bytes: int,
    linear_modes: Mapping[str, str],
    rank: int = 0,
    embedding_trained: bool = True,
    output_layer_trained: bool = True,
) -> ActivationBreakdown:
    """Saved activations of the first pipeline stage at its peak (Megatron's accounting)."""
    layout.check_fits(shape)
    e = element_bytes
    T, T_s = float(layout.tokens), layout.sharded_tokens
    h = shape.hidden_size
    in_flight = layout.in_flight_microbatches()
    layers = shape.num_layers // layout.pp
    kwargs = {"element_bytes": e, "linear_modes": linear_modes, "rank": rank}
    if layout.recompute == "full":
        per_layer = e * T_s * h  # the checkpointed layer input
        recomputed = sum(layer_activation_terms(shape, layout, **kwargs).values())
    else:
        per_layer = sum(layer_activation_terms(shape, layout, **kwargs).values())
        recomputed = 0.0
    # Token ids are replicated on every TP rank; a frozen embedding keeps no ids for backward.
    embedding = (TOKEN_ID_BYTES * T if embedding_trained else 0.0)
    embedding += DROPOUT_MASK_BYTES * T_s * h if shape.dropout else 0.0
    output = 0.0
    if layout.pp == 1:
        vocab = shape.padded_vocab_size(layout.tp)
        output_input, _ = _linear_saved("dense" if output_layer_trained else "frozen",
                                        tokens=T_s, width=h, adapter_tokens=T_s, rank=0, e=e)
        # Final norm input; output-layer input; Megatron's vocab-parallel cross entropy keeps
        # the fp32 softmax of its [T, V/tp] logits.
        output = e * T_s * h + output_input + FP32_BYTES * T * vocab / layout.tp
    return ActivationBreakdown(
        per_layer=per_layer,
        layers=per_layer * layers * in_flight,
        embedding=embedding * in_flight,
        recomputed_layer=recomputed,
        output=output,
    )


def _element_bytes(precision: str) -> int:
    return FP32_BYTES if precision == "fp32" else BF16_BYTES


# ----------------------------------------------------------------------------- methods


def _adam_bytes(params: float, precision: str, distributed_optimizer: bool,
                dp: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) of ``params`` trained by Megatron's Adam."""
    shard = dp if distributed_optimizer else 1
    if precision == "bf16":
        # bf16 param, fp32 main_grad, fp32 master + m + v (Megatron: 18, or 6 + 12/dp).
        return BF16_BYTES * params, FP32_BYTES * params, 3 * FP32_BYTES * params / shard
    # fp32 params are their own masters: fp32 grad, m + v.
    return FP32_BYTES * params, FP32_BYTES * params, 2 * FP32_BYTES * params / shard


def _check_targets(targets: tuple[str, ...]) -> None:
    if not targets:
        raise ValueError(f"targets is empty; choose from {list(TARGET_LINEARS)}")
    for name in targets:
        if name not in TARGET_LINEARS:
            raise ValueError(f"targets contains {name!r}; valid targets are {list(TARGET_LINEARS)}")


def dense_adam_memory(
    shape: ModelShape, layout: Layout, *, distributed_optimizer: bool = True,
    precision: str = "bf16",
) -> MemoryBreakdown:
    """Every parameter trained by Megatron's Adam (the baseline of Megatron's formula)."""
    _choice("precision", precision, PRECISIONS)
    params = stage_parameters(shape, layout)
    weights, grads, state = _adam_bytes(params.targets + params.non_targets, precision,
                                        distributed_optimizer, layout.dp)
    activations = stage_activation_bytes(
        shape, layout, element_bytes=_element_bytes(precision),
        linear_modes=dict.fromkeys(TARGET_LINEARS, "dense"),
    )
    return MemoryBreakdown("dense_adam", precision, weights, grads, state, 0.0, 0.0,
                           activations.total)


def lora_memory(
    shape: ModelShape, layout: Layout, *, lora_rank: int = 256,
    distributed_optimizer: bool = True, precision: str = "bf16",
    targets: tuple[str, ...] = TARGET_LINEARS,
) -> MemoryBreakdown:
    """Frozen base model; adapters on ``targets`` trained by Megatron's Adam.

    Everything that is not an adapter is frozen (embeddings, norms, biases, output layer), as in
    the usual LoRA recipe, so those layers save no inputs for weight gradients either.
    """
    _choice("precision", precision, PRECISIONS)
    _check_targets(targets)
    params = stage_parameters(shape, layout)
    adapters = lora_adapter_parameters(shape, layout, lora_rank, targets)
    a_weights, a_grads, a_state = _adam_bytes(adapters, precision, distributed_optimizer,
                                              layout.dp)
    base = _element_bytes(precision) * (params.targets + params.non_targets)
    modes = {name: ("lora" if name in targets else "frozen") for name in TARGET_LINEARS}
    activations = stage_activation_bytes(
        shape, layout, element_bytes=_element_bytes(precision), linear_modes=modes,
        rank=lora_rank, embedding_trained=False, output_layer_trained=False,
    )
    return MemoryBreakdown("lora", precision, base + a_weights, a_grads, a_state, 0.0, 0.0,
                           activations.total)


def logra_memory(
    shape: ModelShape, layout: Layout, *, sketch_rank: int = 256,
    precision: str = "bf16_sharded_master", distributed_optimizer: bool = True,
    non_targets: str = "adam", targets: tuple[str, ...] = TARGET_LINEARS,
) -> MemoryBreakdown:
    """Sketched ``targets``; the rest trained by Megatron's Adam (library mode) or frozen.

    ``fp32``: fp32 params everywhere, each DP rank keeps the full sketch and row moments.
    ``bf16_sharded_master``: bf16 params; each DP rank keeps fp32 masters and row moments for
    its 1/dp share of target rows. Non-target parameters follow Megatron's Adam in the same
    precision (bf16 with fp32 grads and state; fp32).
    """
    _choice("precision", precision, LOGRA_PRECISIONS)
    _choice("non_targets", non_targets, NON_TARGET_TRAINING)
    _check_targets(targets)
    _positive("sketch_rank", sketch_rank, "use the sketch rank, e.g. 256")
    params = stage_parameters(shape, layout, targets)
    rows, cols = _target_sums(shape, layout, targets)
    sharded = precision == "bf16_sharded_master"
    adam_precision = "bf16" if sharded else "fp32"
    e = _element_bytes(adam_precision)
    if non_targets == "adam":
        weights, grads, state = _adam_bytes(params.non_targets, adam_precision,
                                            distributed_optimizer, layout.dp)
    else:
        weights, grads, state = e * params.non_targets, 0.0, 0.0
    weights += e * params.targets
    shard = layout.dp if sharded else 1
    if sharded:
        state += FP32_BYTES * params.targets / shard  # fp32 master shard
    state += FP32_BYTES * rows / shard  # RowAdam second moment, one per output row
    sketches = FP32_BYTES * rows * sketch_rank  # full buffer: accumulated before any reduction
    projections = FP32_BYTES * sketch_rank * cols
    modes = {name: ("sketched" if name in targets else
                    ("dense" if non_targets == "adam" else "frozen")) for name in TARGET_LINEARS}
    activations = stage_activation_bytes(
        shape, layout, element_bytes=e, linear_modes=modes, rank=sketch_rank,
        embedding_trained=non_targets == "adam", output_layer_trained=non_targets == "adam",
    )
    return MemoryBreakdown("logra", precision, weights, grads, state, sketches, projections,
                           activations.total)


# ----------------------------------------------------------------------------- Megatron's formula


@dataclass(frozen=True)
class MegatronFormula:
    """Megatron-LM's theoretical memory of dense training on the first pipeline stage (bytes).

    Attributes:
        weight_and_optimizer: parameters of the most loaded shard times 18 (or 6 + 12/dp).
        activations: the activation estimate of the branch Megatron picks.
        per_layer_activations: one layer's activations per microbatch in that branch.
        branch: ``sequence_parallel_selective`` (Korthikanti's ``sbh(18 + 4F/h)/t`` per layer)
            or ``without_sequence_parallel`` (``sbh(10 + 24/t)`` per layer, bf16 logits and a
            5% overhead factor), used for every other setting.
    """

    weight_and_optimizer: float
    activations: float
    per_layer_activations: float
    branch: str

    @property
    def total(self) -> float:
        return self.weight_and_optimizer + self.activations


MEGATRON_OVERHEAD_FACTOR = 1.05  # the without-SP branch's allowance for temporaries


def megatron_formula(
    shape: ModelShape, layout: Layout, *, distributed_optimizer: bool
) -> MegatronFormula:
    """Megatron-LM's theoretical-memory formula for a dense (non-MoE, non-MLA) GPT.

    A reimplementation for cross-checking :func:`dense_adam_memory`, approximations included:
    biases, q/k norms, post-norms and learned positions are not counted; norm weights are divided
    by tp (they are replicated); the final norm is spread over pipeline stages; token ids are
    divided by tp. Hidden dropout masks are always counted.
    """
    layout.check_fits(shape)
    h, a, g = shape.hidden_size, shape.num_attention_heads, shape.num_query_groups
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    s, b = layout.seq_length, layout.micro_batch_size
    vocab = shape.padded_vocab_size(tp)
    # Parameters.
    norm_size = 1 if shape.normalization == "RMSNorm" else 2
    gated_multiplier = 3 / 2 if shape.gated_mlp else 1
    query_to_hidden = shape.query_width / h
    self_attention = 2 * h * h * ((1 + g / a) * query_to_hidden)
    per_layer_params = 2 * h * (shape.ffn_hidden_size * gated_multiplier + norm_size)
    per_layer_params += self_attention
    embedding = h * vocab
    block = per_layer_params * shape.num_layers + norm_size * h
    most_loaded = (block / pp + embedding) / tp
    if not shape.tied_embeddings and pp == 1:
        most_loaded += embedding / tp
    bytes_per_param = 6 + 12 / dp if distributed_optimizer else 18
    weight_and_optimizer = most_loaded * bytes_per_param
    # Activations.
    sp_selective = layout.sequence_parallel and layout.recompute == "selective"
    if sp_selective:
        per_layer = s * b * h * (18 + 4 * shape.ffn_hidden_size / h)
    else:
        per_layer = s * b * h * (10 + 24 / tp)
    activations = per_layer * shape.num_layers
    activations += 8 * s * b * pp + s * b * h * pp
    if layout.vpp is not None:
        activations *= 1 + (pp - 1) / (pp * layout.vpp)
    elif pp > 1 and layout.num_microbatches is not None:
        activations *= min(1, layout.num_microbatches / pp)
    if sp_selective:
        if pp == 1:
            activations += s * b * h * 4 * (1 + vocab / h)
        activations /= tp
        return MegatronFormula(weight_and_optimizer, activations, per_layer / tp,
                               "sequence_parallel_selective")
    if pp == 1:
        activations += (s * b * vocab / tp + s * b * h) * 2
    activations *= MEGATRON_OVERHEAD_FACTOR
    return MegatronFormula(weight_and_optimizer, activations, per_layer,
                           "without_sequence_parallel")


# ----------------------------------------------------------------------------- all methods


@dataclass(frozen=True, kw_only=True)
class MethodSettings:
    """What the three methods are compared with."""

    distributed_optimizer: bool = True
    precision: str = "bf16"
    """Dense Adam and LoRA precision (``bf16`` or ``fp32``)."""
    lora_rank: int = 256
    sketch_rank: int = 256
    logra_precision: str = "bf16_sharded_master"
    logra_non_targets: str = "adam"
    targets: tuple[str, ...] = TARGET_LINEARS


def estimate_all(
    shape: ModelShape, layout: Layout, settings: MethodSettings | None = None
) -> dict[str, MemoryBreakdown]:
    """``{"dense_adam": ..., "lora": ..., "logra": ...}`` for one model and layout."""
    st = settings or MethodSettings()
    return {
        "dense_adam": dense_adam_memory(shape, layout, precision=st.precision,
                                        distributed_optimizer=st.distributed_optimizer),
        "lora": lora_memory(shape, layout, lora_rank=st.lora_rank, precision=st.precision,
                            distributed_optimizer=st.distributed_optimizer, targets=st.targets),
        "logra": logra_memory(shape, layout, sketch_rank=st.sketch_rank,
                              precision=st.logra_precision,
                              distributed_optimizer=st.distributed_optimizer,
                              non_targets=st.logra_non_targets, targets=st.targets),
    }


def fits(breakdown: MemoryBreakdown, gpu_mem_gib: float) -> bool:
    """Whether the estimate is within one GPU's memory (every GPU holds at most this much)."""
    if gpu_mem_gib <= 0:
        raise ValueError(f"gpu_mem_gib={gpu_mem_gib} must be > 0; give the GPU memory in GiB")
    return breakdown.total <= gpu_mem_gib * GIB
