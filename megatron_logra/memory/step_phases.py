"""Transient bytes of the parts of a LoGRA step that run after backward (no activations live).

Backward frees the saved activations before ``optimizer.step()``; what the step then builds
can still set the peak when the activations are small against the vocabulary or the weights:

* paper mode's update ratio needs ``||W_targets||``, computed target by target
  (:func:`paper_weight_norm_bytes`);
* the predicted-KL step control (``logra.kl_control.enabled``) gathers the proposal's
  directions and streams its probe: one piece (a response) at a time through a forward-mode
  pass whose attention blocks and MLP chunks are bounded, the output layer over 64 counted
  positions at a time reduced into the KL at once; it keeps the final hidden states of the
  counted positions (and, when the output layer trains, a copy of its weight) across the merge
  and measures the realised KL with a plain pass per piece (:func:`kl_probe_bytes`).

Each is measured against the live-tensor tracker (tools/estimate_vs_measured.py). Symbols as in
:mod:`.estimate`; ``P`` = probe tokens on the rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_logra.memory.shapes import Layout, ModelShape
from megatron_logra.norm_blocks import norm_block_rows

FLOAT64_BYTES = 8
KL_CHUNK_POSITIONS = 64
"""Counted positions per output-layer chunk of the probe (``OUTPUT_CHUNK_POSITIONS`` of
``mcore/kl_probe/stream.py``)."""


@dataclass(frozen=True)
class KLProbe:
    """The predicted-KL step control's probe on one DP rank: ``sequences`` pieces of
    ``tokens_per_sequence`` tokens, every one counted (logra.kl_control.probe_responses /
    probe_max_tokens); ``output_trains``: the output layer's weight changes in the update
    (library mode), so the realised KL keeps a copy of it. Under context parallelism each
    piece is padded to a multiple of ``2 cp`` (times TP under SP) and each rank runs
    ``1 / cp`` of its positions (``local_tokens``) against all of its keys."""

    sequences: int
    tokens_per_sequence: int
    output_trains: bool = False

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


PROBE_BLOCK_ELEMENTS = 2**24
"""Elements of one block of the sdpa tangent rule (``mcore/models/sdpa_forward_ad.py``)."""
PROBE_BLOCK_ROWS = 256
"""Query rows of one such block at most (the rule's ``BLOCK_ROWS``)."""
PROBE_ATTENTION_BLOCK_COPIES = 2
"""Block-sized tensors alive at once in that rule: the probabilities and the weighted score
tangent, each updated in place (measured: 2.0)."""
PROBE_MLP_CHUNK_ELEMENTS = 2**22
"""Elements of one ``[rows, ffn/t]`` slice of the probe's chunked MLP
(``mcore/kl_probe/stream.py``)."""

# What one piece's pass holds besides those, in tensors of the piece's length, fitted to the
# live-tensor tracker on two-layer models where each term dominates in turn, fp32 and bf16
# alike (the second layer is the wider: its input carries a tangent, the first one's does not;
# docs/LOG.md, 2026-12-03): q/k/v, their rotated copies, the rule's inputs in its layout, the
# residual stream and the norm's output, each with its tangent in a forward-mode pass.
PROBE_ATTENTION_WIDTH_COPIES = 23.5
"""``[L, qd/t]`` tensors beside the rule's blocks (measured 23.1-23.5)."""
PLAIN_ATTENTION_WIDTH_COPIES = 10.5
"""The same in a plain pass (the fused kernel, no blocks; measured 10.1-11.0)."""
PROBE_MLP_COPIES = 14.0
"""``[rows, ffn/t]`` slices alive in a chunk of the MLP with tangents: fc1's output and tangent
(4: fc1 is two ffn wide), the gate's SiLU and the up half's offset with theirs, the product
rule's terms (measured 13.9)."""
PLAIN_MLP_COPIES = 5.0
"""The same in a plain pass (measured 5.0)."""
PROBE_HIDDEN_COPIES = 11.3
"""``[L, h]`` tensors beside the MLP's chunk: the residual stream, the norm's output, the
chunks' outputs before and after their concatenation, with tangents (measured 11.3)."""
PLAIN_HIDDEN_COPIES = 4.0
"""The same in a plain pass (measured 4.0)."""
PREDICTED_CHUNK_BYTES = 64.5
"""Bytes per element of a ``[64, V/t]`` output-layer chunk while its predicted KL is reduced:
the fp32 logits and tangent, their float64 copies and the Fisher form's temporaries (measured
64.1-64.3, fp32 and bf16 models alike: the chunk is fp32 either way)."""
REALISED_CHUNK_BYTES = 80.5
"""The same for the realised KL: old and new fp32 logits and the exact KL's float64
temporaries (measured 80.2-80.3)."""


def _piece_pass_bytes(shape: ModelShape, layout: Layout, tokens: int, e: int,
                      tangents: bool) -> float:
    """The widest moment of one probe piece's pass through a layer: its core attention (with
    ``tangents``, the tangent rule's blocks, bounded by :data:`PROBE_BLOCK_ELEMENTS` and
    :data:`PROBE_BLOCK_ROWS`) with the piece's attention-width tensors, or a chunk of its MLP
    with the piece's hidden-width tensors, whichever is larger."""
    t = layout.tp
    heads = shape.num_attention_heads / t
    ffn = shape.fc1_width / 2 / t
    rows = min(tokens, max(1, PROBE_MLP_CHUNK_ELEMENTS // ffn))
    width = tokens * shape.query_width / t
    hidden = tokens * shape.hidden_size
    # Under context parallelism a rank's two chunks of queries attend, one rule call each, to
    # up to the piece's whole gathered keys.
    keys = tokens * layout.cp
    queries = tokens // 2 if layout.cp > 1 else tokens
    gathered = 2 * keys * shape.kv_width / t if layout.cp > 1 else 0.0
    if tangents:
        block = min(PROBE_BLOCK_ELEMENTS, heads * min(PROBE_BLOCK_ROWS, queries) * keys)
        attention = (PROBE_ATTENTION_BLOCK_COPIES * block + PROBE_ATTENTION_WIDTH_COPIES * width
                     + 2 * gathered)
        mlp = PROBE_MLP_COPIES * rows * ffn + PROBE_HIDDEN_COPIES * hidden
    else:
        attention = PLAIN_ATTENTION_WIDTH_COPIES * width + gathered
        mlp = PLAIN_MLP_COPIES * rows * ffn + PLAIN_HIDDEN_COPIES * hidden
    return e * max(attention, mlp)


def kl_probe_bytes(shape: ModelShape, layout: Layout, probe: KLProbe, e: int,
                   direction_bytes: float) -> float:
    """The most the streamed KL step control holds at once beyond the persistent state.

    Predicting: the proposal's directions (``-lr D`` per target, fp32, ``direction_bytes``),
    the final hidden states kept for the realised KL (``[counted, h]`` per piece), and one
    piece's forward-mode pass or, after it, its output-layer chunk. Realising, after the
    merge: the kept hidden states (and a copy of the output weight when it trains), and one
    piece's plain forward or its chunk of old and new logits."""
    vocab = shape.padded_vocab_size(layout.tp) / layout.tp
    h, piece = shape.hidden_size, probe.local_tokens(layout)
    kept = e * probe.rank_tokens(layout) * h
    weight = e * vocab * h if probe.output_trains else 0.0
    chunk = min(KL_CHUNK_POSITIONS, piece) * vocab
    predicting = direction_bytes + kept + max(
        _piece_pass_bytes(shape, layout, piece, e, tangents=True),
        PREDICTED_CHUNK_BYTES * chunk)
    realising = kept + weight + max(
        _piece_pass_bytes(shape, layout, piece, e, tangents=False),
        REALISED_CHUNK_BYTES * chunk)
    return max(predicting, realising)
