"""Saved activations of one training step, per layer and per pipeline stage.

Per Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
section 4 and Table 2), generalised to grouped-query attention, separate head width, gated MLPs
and dropout-free models, and multiplied by the microbatches in flight exactly as Megatron-LM's
theoretical-memory formula does; each target linear saves what its training method keeps
(dense: its input; sketched: ``X A^T``; LoRA: its input and the adapter's ``X A^T``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from megatron_logra.memory.shapes import (
    BF16_BYTES,
    DROPOUT_MASK_BYTES,
    FP32_BYTES,
    TOKEN_ID_BYTES,
    Layout,
    ModelShape,
    check_choice,
)

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
    check_choice("linear mode", mode, LINEAR_MODES)
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


def element_bytes(precision: str) -> int:
    return FP32_BYTES if precision == "fp32" else BF16_BYTES
