"""Saved activations of one training step, per layer and per pipeline stage.

Per Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
section 4 and Table 2), generalised to grouped-query attention, separate head width, gated MLPs
and dropout-free models, and multiplied by the microbatches in flight exactly as Megatron-LM's
theoretical-memory formula does; each target linear saves what its training method keeps
(dense: its input; sketched: ``X A^T``; LoRA: its input and the adapter's ``X A^T``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from megatron_logra.memory import built_layer, moe_layer
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
    norms_trained: bool = True,
    is_moe: bool = False,
) -> dict[str, float]:
    """Bytes one transformer layer saves for backward for one microbatch, term by term
    (``is_moe``: an MoE layer of ``shape.moe``, whose MLP half is :mod:`.moe_layer`'s).

    With ``layout.attention`` set, the terms of the layer our trainer builds
    (:func:`built_layer_terms`); otherwise Korthikanti et al.'s, as follows.

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
    if layout.attention is not None:
        terms = built_layer_terms(shape, layout, element_bytes=element_bytes,
                                  linear_modes=linear_modes, rank=rank, recompute=recompute,
                                  norms_trained=norms_trained)
        if not is_moe:
            return terms
        terms = {name: value for name, value in terms.items() if name not in moe_layer.MLP_KEYS}
        return terms | moe_layer.moe_mlp_terms(shape, layout, element_bytes=element_bytes,
                                               linear_modes=linear_modes, rank=rank,
                                               norms_trained=norms_trained)
    if is_moe:
        moe_layer.check_estimable(shape, layout)
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
            heads * layout.local_seq_length * layout.seq_length * layout.micro_batch_size
            * score_bytes
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


def built_layer_terms(
    shape: ModelShape,
    layout: Layout,
    *,
    element_bytes: int,
    linear_modes: Mapping[str, str],
    rank: int,
    recompute: str,
    norms_trained: bool,
) -> dict[str, float]:
    """The layer ``mcore/models/gpt.py`` builds (``layout.attention``), term by term; each term
    is a function of :mod:`.built_layer`. ``norms_trained``: the norm weights get gradients
    (every layer's input wants one: a frozen embedding's output is made to, see
    ``mcore/models/grad_anchor.py``). ``recompute`` is ``none`` or ``selective`` (core attention rebuilt in
    backward from its kept inputs: its own saved tensors go, its output stays if
    ``linear_proj`` keeps it)."""
    e = element_bytes
    t = layout.tp
    T, T_s = float(layout.tokens), layout.sharded_tokens
    widths = {target.name: target.local_cols(t) for target in shape.targets()}
    tokens = {"linear_qkv": T_s, "linear_proj": T, "linear_fc1": T_s, "linear_fc2": T}
    modes = {name: linear_modes.get(name, "dense") for name in tokens}

    def linear(name: str) -> tuple[float, float]:
        return _linear_saved(modes[name], tokens=tokens[name], width=widths[name],
                             adapter_tokens=T_s, rank=rank, e=e)

    proj_keeps_input = modes["linear_proj"] in ("dense", "lora")
    terms: dict[str, float] = {}
    terms["input_norm"] = built_layer.norm_saved_bytes(
        shape, T_s, weight_trained=norms_trained)
    terms["linear_qkv_input"], terms["linear_qkv_lowrank"] = linear("linear_qkv")
    # Context-parallel attention saved with its layer keeps gathered keys and values instead.
    gathered = layout.cp > 1 and recompute == "none"
    terms["qkv_output"] = built_layer.qkv_output_bytes(shape, layout, e, cp_gathered=gathered)
    terms["qk_norm"] = built_layer.qk_norm_saved_bytes(shape, layout, e)
    terms["rotary"] = built_layer.rotary_bytes(shape, layout, e, cp_gathered=gathered)
    if recompute == "none":
        terms["core_attention"] = built_layer.core_attention_bytes(
            shape, layout, e, proj_keeps_input=proj_keeps_input)
    elif proj_keeps_input:
        terms["core_attention_output"] = e * T * shape.query_width / t
    # linear_proj's input is core attention's output (sdpa) or its contiguous copy (local),
    # both counted above: only the adapter's or the sketch's low-rank activation is added.
    terms["linear_proj_lowrank"] = linear("linear_proj")[1]
    terms["pre_mlp_norm"] = built_layer.norm_saved_bytes(
        shape, T_s, weight_trained=norms_trained)
    terms["linear_fc1_input"], terms["linear_fc1_lowrank"] = linear("linear_fc1")
    terms["gated_mlp"] = built_layer.gated_mlp_bytes(shape, layout, e)
    terms["linear_fc2_input"], terms["linear_fc2_lowrank"] = linear("linear_fc2")
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
    temporaries: float = 0.0
    """The model our trainer builds: gradients alive beside the saved activations at the
    backward's peak (not in ``total``, which counts what is saved)."""
    freed_before_peak: float = 0.0
    """The model our trainer builds: saved bytes the backward has already freed when it peaks."""

    @property
    def at_peak(self) -> float:
        """Saved activations still alive at the backward's peak."""
        return self.total - self.freed_before_peak

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
    norms_trained: bool | None = None,
) -> ActivationBreakdown:
    """Saved activations of the first pipeline stage at its peak (Megatron's accounting, or
    with ``layout.attention`` set the model our trainer builds). ``norms_trained`` defaults to
    ``embedding_trained`` (our methods train both or neither)."""
    layout.check_fits(shape)
    if norms_trained is None:
        norms_trained = embedding_trained
    e = element_bytes
    T, T_s = float(layout.tokens), layout.sharded_tokens
    h = shape.hidden_size
    in_flight = layout.in_flight_microbatches()
    layers = shape.num_layers // layout.pp
    built = layout.attention is not None
    kwargs = {"element_bytes": e, "linear_modes": linear_modes, "rank": rank,
              "norms_trained": norms_trained}
    if shape.moe is not None:
        moe_layer.check_estimable(shape, layout)
    # (is_moe, layers of that kind on the stage, one layer's saved bytes); pp = 1 with experts.
    kinds = [(is_moe, count if shape.moe is not None else layers,
              sum(layer_activation_terms(shape, layout, is_moe=is_moe, **kwargs).values()))
             for is_moe, count in shape.layer_kinds()]
    if layout.recompute == "full":
        # One input kept per checkpointed group; one group rebuilt at a time in backward (the
        # widest kind of layer, when MoE and dense layers alternate).
        group = min(layout.recompute_num_layers, layers) if built else 1
        groups = -(-layers // group)
        per_layer = e * T_s * h  # the checkpointed input
        recomputed = group * max(saved for _, _, saved in kinds)
        stage_layers = per_layer * groups * in_flight
    else:
        per_layer = sum(count * saved for _, count, saved in kinds) / layers
        recomputed = 0.0
        stage_layers = per_layer * layers * in_flight
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
        final_norm = e * T_s * h
        if built:
            final_norm = built_layer.norm_saved_bytes(shape, T_s,
                                                      weight_trained=norms_trained)
            final_norm += built_layer.cross_entropy_target_bytes(layout)
        output = final_norm + output_input + FP32_BYTES * T * vocab / layout.tp
    breakdown = ActivationBreakdown(
        per_layer=per_layer,
        layers=stage_layers,
        embedding=embedding * in_flight,
        recomputed_layer=recomputed,
        output=output,
    )
    if not built:
        return breakdown
    return _at_backward_peak(shape, layout, breakdown, e, linear_modes, rank,
                             output_layer_trained=output_layer_trained)


def _at_backward_peak(shape: ModelShape, layout: Layout, saved: ActivationBreakdown, e: int,
                      linear_modes: Mapping[str, str], rank: int, *,
                      output_layer_trained: bool) -> ActivationBreakdown:
    """The model our trainer builds peaks at one of two moments of its backward: in the
    output layer (everything saved but the cross entropy's softmax, which its gradient
    replaces, is alive beside the logits' gradients) or in the last
    layer's MLP (the output stage and the last fc2 are freed, beside the MLP's gradients)."""
    T, T_s = float(layout.tokens), layout.sharded_tokens
    last_is_moe = shape.moe is not None and shape.moe.is_moe_layer(shape.num_layers - 1)
    if last_is_moe:
        last_fc2 = moe_layer.expert_fc2_saved(shape, layout, e, linear_modes, rank)
        temporaries = moe_layer.moe_backward_temporaries(shape, layout, e)
    else:
        last_fc2 = sum(_linear_saved(linear_modes.get("linear_fc2", "dense"), tokens=T,
                                     width=shape.ffn_hidden_size / layout.tp,
                                     adapter_tokens=T_s, rank=rank, e=e))
        temporaries = built_layer.backward_temporaries(shape, layout, e)
    freed = built_layer.freed_before_backward_peak(shape, layout, e, output_bytes=saved.output,
                                                   last_fc2_bytes=last_fc2)
    mlp = (freed, temporaries)
    softmax = FP32_BYTES * T * shape.padded_vocab_size(layout.tp) / layout.tp
    output_temporaries = built_layer.output_backward_temporaries(
        shape, layout, e, output_layer_trained=output_layer_trained)
    # The output layer's backward runs before any layer is rebuilt under full recompute.
    rebuilt = saved.recomputed_layer if layout.recompute == "full" else 0.0
    output = (softmax + rebuilt, output_temporaries)
    moments = [mlp, output]
    if layout.attention == "local":
        moments.append(built_layer.local_recompute_moment(shape, layout, e, freed_mlp=freed))
    moment = max(moments, key=lambda m: saved.total - m[0] + m[1])
    return dataclasses.replace(saved, freed_before_peak=moment[0], temporaries=moment[1])


def element_bytes(precision: str) -> int:
    return FP32_BYTES if precision == "fp32" else BF16_BYTES
