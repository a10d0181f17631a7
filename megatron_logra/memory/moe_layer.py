"""What an MoE layer our trainer builds holds during a step (no torch), beside its attention.

The MoE decoder layer (``mcore/models/moe.py``: Megatron's ``MoELayer`` with its ``TopKRouter``,
its token dispatcher and ``SequentialMLP`` experts over the sketch-capable linears) keeps its
attention's tensors (:mod:`.built_layer`, as a dense layer) and, in place of the dense MLP's,
what is listed here. Found by listing the storages autograd saves in one MoE layer (a
saved-tensor hook with the module that saves each) and checked against the measured peak of
whole steps (tools/estimate_vs_measured.py ``--experts``, tests/unit/test_estimate_vs_measured.py).

**Balanced routing.** The experts' tensors are counted for ``k T`` routed token copies on a
rank, ``k T / E`` per expert, as if the router spread tokens evenly. For tensors that are
linear in the tokens (everything the experts save) the sum over experts is exact whatever the
routing on one process -- ``k T`` copies are routed in all -- and under expert parallelism it is
the expected load: a rank's ``E / ep`` experts receive ``k T`` copies from the ``ep`` ranks in
balance, and more under a skewed router (a rank whose experts are twice as popular holds twice
the expert activations). Only the single-process case (``ep = tp = 1``) is measured.

Symbols as in :mod:`.estimate`; ``k`` = top-k, ``E`` experts, ``F_e`` one expert's FFN width,
``F_s`` the shared expert's, ``T`` the microbatch's tokens (``T_s`` its sequence shard).
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron_logra.memory import built_layer
from megatron_logra.memory.shapes import TOKEN_ID_BYTES, Layout, ModelShape

ROUTING_MAP_BYTES = 1
"""The router's boolean ``[E, T]`` routing map, saved by the dispatcher's permutation."""
MLP_KEYS: tuple[str, ...] = ("pre_mlp_norm", "linear_fc1_input", "linear_fc1_lowrank",
                             "gated_mlp", "linear_fc2_input", "linear_fc2_lowrank")
"""The terms of :func:`megatron_logra.memory.activations.built_layer_terms` that belong to a
dense layer's MLP (an MoE layer replaces them)."""


def routed_tokens(shape: ModelShape, layout: Layout) -> float:
    """Routed token copies the rank's experts process per microbatch: ``k T`` (balanced; under
    TP the dispatcher gathers the TP group's sequence shards, so each expert-TP rank sees the
    whole microbatch's copies with ``F_e / t`` columns)."""
    return shape.moe.topk * float(layout.tokens)


def _mlp_saved(mode: str, *, tokens: float, width: float, rank: int, e: int) -> float:
    """What one MLP linear keeps for its weight gradient (``dense``: X; ``sketched``: X A^T)."""
    if mode == "sketched":
        return e * tokens * rank
    if mode == "dense":
        return e * tokens * width
    raise ValueError(f"linear mode {mode!r} is not modelled in an MoE layer; the MoE layer's "
                     "MLP linears are either trained by Adam (dense) or sketched")


def _unfused_mlp_bytes(shape: ModelShape, tokens: float, width: float, e: int) -> float:
    """An MLP's activation as :func:`.built_layer.gated_mlp_bytes` counts it (fc1's output,
    and with a gated MLP ``silu(gate)`` and ``up``), over ``tokens`` rows of local ``width``."""
    if not shape.gated_mlp:
        return e * tokens * width
    return e * tokens * 4 * width


def moe_mlp_terms(shape: ModelShape, layout: Layout, *, element_bytes: int,
                  linear_modes: Mapping[str, str], rank: int,
                  norms_trained: bool) -> dict[str, float]:
    """Bytes an MoE layer's MLP half saves for backward for one microbatch, term by term."""
    e, t, moe, h = element_bytes, layout.tp, shape.moe, shape.hidden_size
    T, T_s = float(layout.tokens), layout.sharded_tokens
    kT = routed_tokens(shape, layout)
    fc1_mode = linear_modes.get("linear_fc1", "dense")
    fc2_mode = linear_modes.get("linear_fc2", "dense")
    terms: dict[str, float] = {}
    terms["pre_mlp_norm"] = built_layer.norm_saved_bytes(shape, T_s, weight_trained=norms_trained)
    # The router's gating linear keeps the norm's output (its weight is trained); a dense shared
    # expert's fc1 keeps the same storage.
    terms["router_input"] = e * T_s * h
    # Top-k: the selected experts' indices (int64) and the softmax over their logits, or
    # (pre-softmax) the softmax over all experts' logits.
    terms["router_topk"] = (TOKEN_ID_BYTES + e) * T_s * moe.topk
    if moe.router_pre_softmax:
        terms["router_topk"] += e * T_s * moe.num_experts
    # The dispatcher's permutation keeps the routing map, the probabilities scattered to
    # [E, T] and the sorted token indices of the k T copies.
    terms["dispatch_maps"] = ((ROUTING_MAP_BYTES + e) * moe.num_experts * T_s
                              + TOKEN_ID_BYTES * kT)
    # Experts: the permuted tokens (one storage; each expert's fc1 input is a view of it) or
    # their projections, the unfused gated activation over k T copies, the activation's output
    # kept for its product with the permuted routing probabilities (one [k T] storage), and
    # fc2's input (that product) or its projection.
    fe = moe.expert_ffn_hidden_size / t
    terms["experts_fc1"] = _mlp_saved(fc1_mode, tokens=kT, width=h, rank=rank, e=e)
    terms["experts_gated_mlp"] = _unfused_mlp_bytes(shape, kT, fe, e)
    terms["experts_gated_mlp"] += e * kT * fe + e * kT  # output before the probabilities, probs
    terms["experts_fc2"] = _mlp_saved(fc2_mode, tokens=kT, width=fe, rank=rank, e=e)
    if moe.shared_expert_ffn_hidden_size:
        fs = moe.shared_expert_ffn_hidden_size / t
        terms["shared_fc1"] = (0.0 if fc1_mode == "dense"
                               else _mlp_saved(fc1_mode, tokens=T_s, width=h, rank=rank, e=e))
        terms["shared_gated_mlp"] = _unfused_mlp_bytes(shape, T, fs, e)
        terms["shared_fc2"] = _mlp_saved(fc2_mode, tokens=T, width=fs, rank=rank, e=e)
        if moe.shared_expert_gate:
            # sigmoid(x w) * shared: the product keeps the shared output [T_s, h] and the
            # [T_s, 1] score (the sigmoid keeps it too: one storage); the gate's input is the
            # norm output, counted above.
            terms["shared_gate"] = e * T_s * h + e * T_s
    return {name: value for name, value in terms.items() if value}


MOE_BACKWARD_COPIES = 4
"""``[k T, h]`` tensors alive at the backward's peak in the last MoE layer (measured: 4, the
peak falls in a ``cat``): the gradient of the experts' outputs (the unpermutation's
``index_select`` backward; each expert's share is a view of it), the experts' input gradients
one by one, their concatenation, and one more concatenation of the same size."""


def moe_backward_temporaries(shape: ModelShape, layout: Layout, e: int) -> float:
    """Gradients alive beside the saved activations in the backward of the last layer's MoE
    MLP: :data:`MOE_BACKWARD_COPIES` routed-token-sized gradients, the routing probabilities'
    gradient scattered to ``[T_s, E]`` with its boolean mask and the permuted probabilities'
    ``[k T]`` (measured; no residual-stream gradient is alive at that moment). Under full
    recompute one more ``[T_s, h]`` (the checkpoint's, as the dense layer)."""
    kT, h, E = routed_tokens(shape, layout), shape.hidden_size, shape.moe.num_experts
    T_s = layout.sharded_tokens
    routing = (e + ROUTING_MAP_BYTES) * T_s * E + e * kT
    residual = e * T_s * h if layout.recompute == "full" else 0.0
    return MOE_BACKWARD_COPIES * e * kT * h + routing + residual


def expert_fc2_saved(shape: ModelShape, layout: Layout, e: int,
                     linear_modes: Mapping[str, str], rank: int) -> float:
    """What the last MoE layer's experts' fc2 kept (freed when the backward reaches them)."""
    kT = routed_tokens(shape, layout)
    fe = shape.moe.expert_ffn_hidden_size / layout.tp
    return _mlp_saved(linear_modes.get("linear_fc2", "dense"), tokens=kT, width=fe, rank=rank,
                      e=e)


def check_estimable(shape: ModelShape, layout: Layout) -> None:
    """Raise ValueError for what the MoE estimate does not model."""
    if layout.attention is None:
        raise ValueError(f"{shape.name} has experts: the MoE layer is modelled as our trainer "
                         "builds it; set Layout.attention (memory_estimator: --as-built)")
    if shape.dropout:
        raise ValueError(f"{shape.name}: dropout with experts is not modelled; use "
                         "dropout=False (our trainer sets it to 0)")
