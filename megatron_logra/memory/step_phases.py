"""Transient bytes of the parts of a LoGRA step that run after backward (no activations live).

Backward frees the saved activations before ``optimizer.step()``; what the step then builds
can still set the peak when the activations are small against the vocabulary or the weights:

* paper mode's update ratio needs ``||W_targets||``, computed target by target
  (:func:`paper_weight_norm_bytes`);
* the predicted-KL step control (``logra.kl_control.enabled``) gathers the proposal's
  directions, runs one forward-mode pass on the probe sequences (logits and their tangents),
  reduces them in float64 chunks, keeps the pre-update logits across the merge and measures the
  realised KL with a second forward (:func:`kl_probe_bytes`).

Each is measured against the live-tensor tracker (tools/estimate_vs_measured.py). Symbols as in
:mod:`.estimate`; ``P`` = probe tokens on the rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_logra.memory.shapes import FP32_BYTES, Layout, ModelShape
from megatron_logra.norm_blocks import norm_block_rows

FLOAT64_BYTES = 8
KL_CHUNK_POSITIONS = 64
"""Positions per float64 chunk of the KL reductions (``megatron_logra.kl``'s default)."""
KL_CHUNK_COPIES = 9
"""float64 ``[chunk, V/t]`` tensors alive at once in a chunk of the predicted or realised KL:
both inputs upcast, the tempered logits, their log-softmax and softmax for the old and the new
policy or the tangent, and the products reduced (measured: 9.0 at V = 4096, the chunk's bytes
from the slope between 256- and 512-token probes)."""


@dataclass(frozen=True)
class KLProbe:
    """The predicted-KL step control's probe on one DP rank: ``sequences`` of
    ``tokens_per_sequence`` tokens (logra.kl_control.probe_responses / probe_max_tokens).
    Under context parallelism the probe is padded to a multiple of ``2 cp`` (times TP under
    SP) and each rank takes ``tokens_per_sequence / cp`` positions of it (``local_tokens``)."""

    sequences: int
    tokens_per_sequence: int

    def padded(self, layout: Layout) -> int:
        """The probe sequences' length after the context-parallel padding."""
        if layout.cp == 1:
            return self.tokens_per_sequence
        multiple = 2 * layout.cp * (layout.tp if layout.sequence_parallel else 1)
        return -(-self.tokens_per_sequence // multiple) * multiple

    def local_tokens(self, layout: Layout) -> int:
        """Positions of one probe sequence on a rank."""
        return self.padded(layout) // layout.cp

    @property
    def tokens(self) -> int:
        return self.sequences * self.tokens_per_sequence

    def rank_tokens(self, layout: Layout) -> int:
        """``P``: probe tokens on one rank."""
        return self.sequences * self.local_tokens(layout)


def paper_weight_norm_bytes(shape: ModelShape, layout: Layout,
                            targets: tuple[str, ...]) -> float:
    """Paper mode's ``||W_targets||^2`` as the optimizer computes it: in float64 over row
    blocks of at most :data:`NORM_BLOCK_ELEMENTS` (``blockwise_sq_norm``, squared in place),
    so one block's float64 copy (8 B per element) is alive at a time -- of the largest target
    on the rank, or all of it when it is smaller than a block. (An int16-remainder store also
    rebuilds the block in fp32 first: 4 B per element more, at most 16 MiB, not counted.)"""
    largest = 0
    for target in shape.targets():
        if target.name in targets:
            rows, cols = target.local_rows(layout.tp), target.local_cols(layout.tp)
            largest = max(largest, min(rows, norm_block_rows(cols)) * cols)
    return FLOAT64_BYTES * largest


def kl_chunk_bytes(shape: ModelShape, layout: Layout) -> float:
    """The float64 temporaries of one chunk of a KL reduction over the vocabulary shard."""
    vocab = shape.padded_vocab_size(layout.tp) / layout.tp
    return KL_CHUNK_COPIES * FLOAT64_BYTES * KL_CHUNK_POSITIONS * vocab


PROBE_QUERY_BLOCK = 1024
"""Query rows per block of the sdpa tangent rule (``mcore/models/sdpa_forward_ad.py``)."""
PROBE_ATTENTION_BLOCK_COPIES = 5
"""``[b, a/t, block, s]`` tensors alive at once in that rule: scores, the score tangent, the
probabilities, the centred tangent and its product with the probabilities (measured: 5)."""
PROBE_ATTENTION_BLOCK_COPIES_LATER = 7
"""The same from the second block of query rows on: the previous block's tensors stay bound to
their loop variables while the next block's are computed (measured: 7 at 2048 tokens, two
blocks)."""
PROBE_ATTENTION_WIDTH_COPIES = 15
"""``[P, qd/t]`` tensors alive beside them: query, key, value in the kernel's layout and their
tangents, the head-expanded keys and values and their tangents, the residual stream and the
norm's output with their tangents, the output block (measured: 15 with qd = h)."""
PROBE_MLP_COPIES = 6
"""``[P, fc1/t]`` tensors in the activation dtype alive in fc1's forward hook, where the
sketched direction's output tangent is added to fc1's (measured: 6, plus one fp32 copy)."""


PROBE_CP_KEY_COPIES = 4
"""Under context parallelism, of the ``[P, qd/t]`` copies above those over the keys -- the
head-expanded keys and values and their tangents -- span the whole sequence's keys, and the
gathered keys and values ``[s, 2 kvd/t]`` are kept with their tangents."""


def probe_forward_bytes(shape: ModelShape, layout: Layout, probe: KLProbe, e: int) -> float:
    """The widest moment of the probe's forward-mode pass (no graph is kept): the core-attention
    tangent rule of a layer (quadratic in the probe length, by blocks of query rows), or the
    MLP's fc1 with its tangent, whichever is larger. Under context parallelism the rule runs
    per chunk of queries over up to the whole sequence's (gathered) keys."""
    P, t = probe.rank_tokens(layout), layout.tp
    keys = probe.padded(layout)  # the last chunk's keys: the whole sequence
    queries = probe.local_tokens(layout) // (2 if layout.cp > 1 else 1)  # one rule call
    heads = shape.num_attention_heads / t
    block = min(queries, PROBE_QUERY_BLOCK)
    copies = (PROBE_ATTENTION_BLOCK_COPIES if queries <= block
              else PROBE_ATTENTION_BLOCK_COPIES_LATER)
    attention = copies * e * probe.sequences * heads * block * keys
    width = PROBE_ATTENTION_WIDTH_COPIES * shape.query_width
    if layout.cp > 1:
        width -= PROBE_CP_KEY_COPIES * shape.query_width
        attention += e * probe.sequences * keys * (
            PROBE_CP_KEY_COPIES * shape.query_width + 2 * 2 * shape.kv_width) / t
    attention += e * P * (width + 2 * (shape.query_width + 2 * shape.kv_width)) / t
    mlp = (PROBE_MLP_COPIES * e + FP32_BYTES) * P * shape.fc1_width / t
    return max(attention, mlp)


def kl_probe_bytes(shape: ModelShape, layout: Layout, probe: KLProbe, e: int,
                   direction_bytes: float) -> float:
    """The most the KL step control holds at once beyond the persistent state.

    Predicting: the proposal's directions (``-lr D`` per target, fp32, ``direction_bytes``) and
    either a probe forward's widest moment or its result -- the logits and their tangent
    ``[P, V/t]`` -- with a float64 chunk. Realising, after the merge: the kept pre-update
    logits, and the second forward's widest moment or its logits with a chunk."""
    vocab = shape.padded_vocab_size(layout.tp) / layout.tp
    # Megatron's mixed-precision wrapper hands the last stage's logits back in fp32.
    logits = FP32_BYTES * probe.rank_tokens(layout) * vocab
    forward = probe_forward_bytes(shape, layout, probe, e)
    chunk = kl_chunk_bytes(shape, layout)
    predicting = direction_bytes + max(forward, 2 * logits + chunk)
    # The realised pass is a plain forward (no tangents): about half the widest moment.
    realising = logits + max(forward / 2, logits + chunk)
    return max(predicting, realising)
