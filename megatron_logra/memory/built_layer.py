"""What the transformer layer our trainer builds saves for backward, per attention kind.

Korthikanti et al.'s accounting (:mod:`.activations`) describes Megatron-LM's fused layer; the
model ``mcore/models/gpt.py`` builds (torch norms, Megatron's unfused gated MLP, rotary
embeddings, ``model.attention`` = ``sdpa`` | ``local`` | ``te``) keeps other tensors. Each
function below is one of them, a function of the shape, found by listing the storages autograd
saves in one layer (``LiveTensorTracker``'s saved-tensor hook) and checked against the measured
peak of whole steps (tools/estimate_vs_measured.py, docs/benchmarks.md "Estimator vs
measurement"). Symbols as in :mod:`.estimate`: ``T`` tokens of one microbatch, ``T_s`` its
sequence shard, ``t`` = tp, ``e`` the activation element bytes, ``h``, ``F``, ``qd``, ``kvd``,
``d`` the widths, ``a`` the heads.

``te`` uses Transformer Engine's fused attention and norms on a GPU; it has not been measured
(no GPU was lent): it is counted like ``sdpa`` (a fused kernel keeping q, k, v, its output and
the fp32 log-sum-exp), the nearest measured kind.

Context parallelism (``layout.cp > 1``; ``T`` is then a rank's share of the tokens): the
attention (``mcore/models/cp_attention.py``; a packed row's: ``packed_cp_attention.py``) keeps
the keys and values of the whole sequence (or packed row), all-gathered, instead of its own rotated keys and the qkv output its values were views of; it
concatenates the outputs of its two chunks, so ``linear_proj``'s input is a copy of them; on the
CPU it keeps its additive bottom-right masks between steps (:func:`cp_mask_bytes`).
"""

from __future__ import annotations

from megatron_logra.memory.shapes import FP32_BYTES, TOKEN_ID_BYTES, Layout, ModelShape

CAUSAL_MASK_BYTES = 1
"""``local`` attention's boolean ``[s, s]`` causal mask, made and saved in every layer."""
ROTARY_TABLES = 4
"""Rotary embedding: the cos and sin tables, cast to the activation dtype, are saved once for
queries and once for keys in every layer (``[T, d]`` each)."""


def norm_saved_bytes(shape: ModelShape, tokens: float, *, weight_trained: bool) -> float:
    """A torch RMSNorm / LayerNorm over ``[tokens, h]``, what it keeps besides its output.

    It normalises in fp32: its input is upcast (a new fp32 copy in bf16; the input itself in
    fp32) and kept for the input gradient, with the fp32 ``1/rms`` per token; a trainable weight
    also keeps the fp32 normalised input for its gradient ("the trainable norm's saved
    input")."""
    h = shape.hidden_size
    saved = FP32_BYTES * tokens * h + FP32_BYTES * tokens  # fp32 input, 1/rms
    if weight_trained:
        saved += FP32_BYTES * tokens * h  # the normalised input, for the weight's gradient
    return saved


def qk_norm_saved_bytes(shape: ModelShape, layout: Layout, e: int) -> float:
    """The per-head q and k norms (``model.qk_layernorm``) over ``[T, qd/t]`` and
    ``[T, kvd/t]``: as :func:`norm_saved_bytes` with a trained weight -- the fp32 normalised
    input and the fp32 ``1/rms`` per head and token -- and in bf16 the fp32 copy of the input
    (in fp32 the input is a view of the qkv output, counted there)."""
    if not shape.qk_norm:
        return 0.0
    T, t = layout.tokens, layout.tp
    widths = shape.query_width + shape.kv_width
    heads = shape.num_attention_heads + shape.num_query_groups
    upcast = FP32_BYTES * T * widths / t if e != FP32_BYTES else 0.0
    return upcast + FP32_BYTES * T * widths / t + FP32_BYTES * T * heads / t


def qkv_output_bytes(shape: ModelShape, layout: Layout, e: int, *,
                     cp_gathered: bool = False) -> float:
    """The ``[T, qd + 2 kvd]`` output of ``linear_qkv``: the value heads passed on to core
    attention are views of it, so the whole storage lives as long as they are saved."""
    if layout.attention == "local" and shape.num_query_groups < shape.num_attention_heads:
        return 0.0  # local expands (copies) the grouped values, which frees the views
    if cp_gathered:
        return 0.0  # the values are gathered over CP into a new tensor (core_attention_bytes)
    return e * layout.tokens * (shape.query_width + 2 * shape.kv_width) / layout.tp


def rotary_bytes(shape: ModelShape, layout: Layout, e: int, *, cp_gathered: bool = False) -> float:
    """Rotated queries and keys (new tensors, ``[T, qd + kvd]``; ``cp_gathered``: the keys are
    kept gathered over CP instead) and the rotary tables."""
    T, t = layout.tokens, layout.tp
    keys = 0 if cp_gathered else shape.kv_width
    rotated = e * T * (shape.query_width + keys) / t
    return rotated + ROTARY_TABLES * e * T * shape.head_dim


def core_attention_bytes(shape: ModelShape, layout: Layout, e: int, *,
                         proj_keeps_input: bool) -> float:
    """What core attention keeps beyond q, k (rotated) and the qkv output.

    ``sdpa`` (and ``te``): its output ``[T, qd]`` -- which is also ``linear_proj``'s input, one
    storage -- and the fp32 log-sum-exp per head and token. ``local`` (Megatron's
    ``DotProductAttention``): the softmax probabilities ``[b, a/t, s, s]`` (fp32, and their
    bf16 cast in bf16; "softmax copies"), the causal mask,
    the grouped keys and values expanded to all heads under grouped-query attention, and the
    context made contiguous for ``linear_proj`` (kept only if that linear keeps its input)."""
    T, t = layout.tokens, layout.tp
    heads = shape.num_attention_heads / t
    qd = shape.query_width
    if layout.attention == "local":
        # Softmax in fp32 keeps its fp32 output; in bf16 the product with V keeps its cast too.
        # [b, a/t, s, s] unpacked; one [a/t, L, L] per sequence of a packed row.
        probs = (FP32_BYTES + (e if e != FP32_BYTES else 0)) * heads * T * layout.span
        expanded = 0.0
        if shape.num_query_groups < shape.num_attention_heads:
            expanded = 2 * e * T * qd / t  # repeat_interleave'd keys and values
        context = e * T * qd / t if proj_keeps_input else 0.0
        # One causal mask broadcast over the batch; one per sequence of a packed row.
        mask = layout.seq_length ** 2 if layout.attention_span is None else T * layout.span
        return probs + CAUSAL_MASK_BYTES * mask + expanded + context
    saved = e * T * qd / t + FP32_BYTES * T * heads
    if layout.cp > 1:
        # The whole sequence's keys and values, and linear_proj's copy of the two chunks'
        # concatenated outputs when it keeps its input.
        saved += e * layout.seq_length * layout.micro_batch_size * 2 * shape.kv_width / t
        saved += e * T * qd / t if proj_keeps_input else 0.0
    return saved


def gated_mlp_bytes(shape: ModelShape, layout: Layout, e: int) -> float:
    """Megatron's unfused gated MLP: ``silu(gate) * (up + offset)`` keeps fc1's whole output
    (the gate is a view of it), ``silu(gate)`` and the new ``up + offset`` tensor, ``[T, F]``
    each (a fused SwiGLU kernel would keep fc1's output only)."""
    T, t = layout.tokens, layout.tp
    fc1_out = e * T * shape.fc1_width / t
    if not shape.gated_mlp:
        return fc1_out  # the activation keeps its input
    return fc1_out + 2 * e * T * shape.ffn_hidden_size / t


def backward_temporaries(shape: ModelShape, layout: Layout, e: int) -> float:
    """Gradients alive beside the saved activations at the backward's peak, in the last
    layer's MLP: the gradients of fc2's input, of ``silu(gate)`` and of ``up`` (``[T, F]``
    each) and of the residual stream ``[T_s, h]``, one more ``[T_s, h]`` under full recompute
    (measured; a GeLU MLP's is taken as its two ``[T, F]`` gradients, not measured; bf16 LoRA
    holds one more ``[T, F]`` there, its adapter's input gradient: not counted, -4%)."""
    T, t = layout.tokens, layout.tp
    grads = 3 if shape.gated_mlp else 2
    residual = 2 if layout.recompute == "full" else 1
    return e * T * grads * shape.ffn_hidden_size / t + residual * e * layout.sharded_tokens * shape.hidden_size


def freed_before_backward_peak(shape: ModelShape, layout: Layout, e: int, *,
                               output_bytes: float, last_fc2_bytes: float) -> float:
    """Saved bytes already freed when the backward peaks in the last layer's MLP: the output
    stage's (final norm, output layer, cross entropy: backward starts there) and what the last
    fc2 kept. Under full recompute in fp32 the rebuilt layer's first norm keeps the checkpointed
    input itself (one storage, counted twice in the sum), and the checkpoint keeps the rotary
    table ``[s, d]`` (fp32) once."""
    freed = output_bytes + last_fc2_bytes
    if layout.recompute == "full":
        if e == FP32_BYTES:
            freed += e * layout.sharded_tokens * shape.hidden_size
        # The rotary table of one rank's positions: a sequence's CP share, or a packed row's
        # longest sequence's.
        freed -= FP32_BYTES * (layout.span // layout.cp) * shape.head_dim
    return freed


def output_backward_temporaries(shape: ModelShape, layout: Layout, e: int, *,
                                output_layer_trained: bool) -> float:
    """Gradients alive at the output layer's backward: the fp32 ``[T, V/t]`` gradient of the
    logits (in place of the cross entropy's saved softmax, which is freed), its cast to the
    activation dtype in bf16, and the gradient of the output layer's input ``[T_s, h]``; in
    fp32 a trainable output layer's ``[V/t, h]`` weight gradient before it is added to the
    gradient buffer (measured)."""
    vocab = shape.padded_vocab_size(layout.tp) / layout.tp
    grads = FP32_BYTES * layout.tokens * vocab + e * layout.sharded_tokens * shape.hidden_size
    if e != FP32_BYTES:
        grads += e * layout.tokens * vocab
    elif output_layer_trained:
        grads += e * vocab * shape.hidden_size
    return grads


LOCAL_RECOMPUTE_PROBS_FP32 = 3
"""``local`` with selective recompute, in the rebuilt core attention's backward: fp32
``[b, a/t, s, s]`` tensors alive at once (the rebuilt probabilities and two fp32 gradients),
beside one more in the activation dtype (fp32: a third gradient; bf16: the probabilities'
cast). Measured: 4 fp32 in fp32, 3 fp32 + 1 bf16 in bf16."""
LOCAL_RECOMPUTE_WIDTH_COPIES = 4
"""``[T, qd/t]`` gradients alive there (queries, keys, values, the context; measured: 4)."""


def local_recompute_moment(shape: ModelShape, layout: Layout, e: int, *,
                           freed_mlp: float) -> tuple[float, float]:
    """``(saved bytes freed, temporaries)`` in the backward of ``local`` attention's core
    attention in the last layer (rebuilt there under selective recompute): its MLP's saved
    tensors are freed by then, beside the output stage's (``freed_mlp`` counts those and the
    last fc2's); the ``s x s`` gradients are the temporaries."""
    T, t = layout.tokens, layout.tp
    heads = shape.num_attention_heads / t
    mlp = (e * layout.sharded_tokens * shape.hidden_size  # fc1's input (norm output, dense)
           + gated_mlp_bytes(shape, layout, e)
           + norm_saved_bytes(shape, layout.sharded_tokens, weight_trained=True))
    # Score entries: all of the microbatch's ([b, a/t, s, s], or every block of a packed row)
    # and one call's (the whole microbatch unpacked; one sequence of a packed row, whose
    # blocks' backward runs one at a time).
    scores = heads * T * layout.span
    block = heads * layout.micro_batch_size * layout.span * layout.span
    cast = e if e != FP32_BYTES else 0  # the probabilities' copy in the activation dtype
    # The gradients of one call beside its probabilities: LOCAL_RECOMPUTE_PROBS_FP32 fp32
    # tensors and one in the activation dtype, less the probabilities (and their cast).
    probs = (LOCAL_RECOMPUTE_PROBS_FP32 * FP32_BYTES + e - FP32_BYTES - cast) * block
    if layout.recompute == "selective":
        # Rebuilt for the backward of the checkpointed core attention, every call's at once
        # (otherwise saved, or rebuilt with its layer: already among the activations).
        probs += (FP32_BYTES + cast) * scores
    temporaries = probs + LOCAL_RECOMPUTE_WIDTH_COPIES * e * T * shape.query_width / t
    if layout.recompute == "full" and e != FP32_BYTES:
        # In bf16 the rebuilt layer peaks in its forward's softmax instead: the probabilities'
        # bf16 cast and the context do not exist yet (measured).
        mlp += e * scores + e * T * shape.query_width / t
    return freed_mlp + mlp, temporaries


def cross_entropy_target_bytes(layout: Layout) -> float:
    """Megatron's vocab-parallel cross entropy keeps the masked int64 targets and a bool mask."""
    return (TOKEN_ID_BYTES + 1) * layout.tokens


def cp_mask_bytes(layout: Layout, e: int, seq_length: int | None = None) -> float:
    """The CPU's additive bottom-right masks of context-parallel attention, made once per
    shape and kept between steps (CUDA's kernels need none): rank ``r`` masks its chunks
    ``c > 0``, ``[L, (c + 1) L]`` each (``L = s / 2 cp``); the largest rank's two chunks
    ``r, 2 cp - 1 - r`` with ``r > 0`` hold ``(2 cp + 1) L^2``. ``seq_length``: another
    sequence length than the layout's (the KL probe's). A packed row's masks are its
    sequences' (``L = span / 2 cp``, counted at the longest span: a row of shorter sequences
    caches smaller ones, at most eight shapes)."""
    if layout.cp == 1 or not layout.cpu or layout.attention == "local":
        return 0.0
    chunk = (seq_length or layout.span) / (2 * layout.cp)
    return e * (2 * layout.cp + 1) * chunk * chunk


def local_attention_buffer_bytes(shape: ModelShape, layout: Layout, e: int) -> float:
    """``local`` attention's ``baddbmm`` input ``[b a/t, s, s]``, which Megatron allocates once
    in its global memory buffer and keeps between steps (persistent)."""
    if layout.attention != "local":
        return 0.0
    heads = shape.num_attention_heads / layout.tp
    # Sized by the largest call: the whole microbatch unpacked, the longest sequence packed.
    return e * layout.micro_batch_size * heads * layout.span * layout.span
