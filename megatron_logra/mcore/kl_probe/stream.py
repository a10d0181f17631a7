"""The KL probe streamed: bounded pieces through the model, the output layer chunk by chunk.

The probe's memory must not grow with ``tokens x vocabulary``. Two things bound it:

* **pieces**: each :class:`~megatron_logra.probe_batch.ProbePiece` (today one response at its
  real length) runs through the model on its own, so a forward-mode pass holds one piece's
  activations and tangents, never the whole probe's;
* **the output layer, position chunk by position chunk**: during a probe forward the last
  stage's output layer is replaced by a capture of its input (the final hidden states, with
  their tangent), so Megatron's ``[s, b, V/tp]`` logits are never formed. The caller then gets,
  for each chunk of at most :data:`OUTPUT_CHUNK_POSITIONS` counted positions of the piece, this
  rank's vocabulary shard of the logits and of their tangent, computed as Megatron's
  column-parallel output layer computes them (``X W^T`` in the model's dtype on the
  sequence-gathered input, then the last stage's fp32 cast), and reduces it into its sums at
  once. Only counted positions reach the output layer (a prompt's logits are never needed).

Inside a piece, every dense layer's MLP runs over the piece's positions in chunks
(:data:`MLP_CHUNK_ELEMENTS`): it is position-wise, so the result is the same, and its
``[tokens, ffn]`` temporaries with their tangents -- the widest of a forward-mode pass -- stay
bounded. (The core attention's tangent rule bounds its own blocks, ``sdpa_forward_ad``.)

Every rank runs the same pieces in the same order (the forwards are collective over tensor,
pipeline and -- with expert parallelism -- expert-parallel ranks); :func:`layout_pieces` pads
each piece to what the layout needs (a multiple of TP under sequence parallelism) and, with
expert parallelism, makes the piece count and lengths agree over the expert-parallel group
(ranks with fewer pieces run uncounted padding pieces).

Shape names: T = tokens of a piece, N = its counted positions, C = a chunk of them, h = hidden,
V = this rank's vocabulary shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
from megatron.core.transformer.mlp import MLP

from megatron_logra.mcore.kl_probe.logit_jvp import (
    LOST_TANGENT,
    LowRankDirection,
    PipelinePosition,
    probe_mode,
    staged_forward,
)
from megatron_logra.mcore.models.sharding import unwrap_model
from megatron_logra.mcore.models.targets import SketchTarget
from megatron_logra.mcore.tensor_parallel.seq_collectives import all_gather_first_dim
from megatron_logra.probe_batch import ProbeBatch, ProbePiece

MLP_CHUNK_ELEMENTS = 2**22
"""Elements of one ``[rows, ffn/tp]`` slice of a dense MLP in a probe forward: the MLP runs over
the piece's positions in chunks of that many rows (it is position-wise), so its widest moment --
fc1's output and its tangent, the gated activation's products and theirs, ~14 such slices -- is
bounded whatever the piece's length (16 MiB a slice in fp32; at ffn 18944 / tp 2 with sequence
parallelism, 221 rows per rank)."""
OUTPUT_CHUNK_POSITIONS = 64
"""Counted positions per chunk of the output layer: a chunk's fp32 logits and tangent and the
KL's float64 temporaries are ``64 x V/tp`` each (~80 MB per float64 copy at a 152k vocabulary,
the authors' chunk)."""


@dataclass(frozen=True)
class FinalHidden:
    """The output layer's input at a piece's counted positions, and its weight.

    Attributes:
        hidden: ``[N, h]`` final hidden states (after the final norm), gathered over sequence
            parallelism, in the model's dtype.
        tangent: ``[N, h]`` their forward-mode tangent, or None in a plain forward.
        weight: this rank's ``[V, h]`` output weight shard (the embedding's when tied).
    """

    hidden: torch.Tensor
    tangent: torch.Tensor | None
    weight: torch.Tensor


def output_layer_chunks(
    final: FinalHidden, weight: torch.Tensor | None = None,
    chunk_positions: int = OUTPUT_CHUNK_POSITIONS,
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """``(logits, tangent)`` ``[C, V]`` fp32 for consecutive chunks of the counted positions:
    what Megatron's output layer computes for them (``weight`` replaces the captured one, e.g.
    a copy kept from before an update)."""
    weight = final.weight if weight is None else weight
    for start in range(0, final.hidden.shape[0], chunk_positions):
        rows = slice(start, start + chunk_positions)
        hidden = final.hidden[rows]
        logits = _as_output(torch.matmul(hidden, weight.t()))
        tangent = None
        if final.tangent is not None:
            tangent = _as_output(torch.matmul(final.tangent[rows], weight.t()))
        yield logits, tangent


def _as_output(logits: torch.Tensor) -> torch.Tensor:
    """Megatron's mixed-precision wrapper hands the last stage's half-precision output back in
    fp32; fp32 and fp64 models' outputs are as computed."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


@dataclass
class _Capture:
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None


def _install_capture(output_layer: torch.nn.Module, capture: _Capture) -> None:
    """Replace the output layer's forward by one that keeps its input and weight and returns
    an empty ``[s, b, 0]`` tensor (what GPTModel then returns as the "logits")."""

    def forward(input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        del runtime_gather_output
        capture.hidden = input_
        capture.weight = output_layer.weight if weight is None else weight
        primal = fwAD.unpack_dual(input_).primal
        return primal.new_empty(*primal.shape[:-1], 0), None

    output_layer.forward = forward


def _last_output_layer(model_chunks: Sequence[torch.nn.Module]) -> torch.nn.Module:
    model = unwrap_model(model_chunks[-1])
    layer = getattr(model, "output_layer", None)
    if layer is None or not model.post_process:
        raise RuntimeError("the last model chunk of the last pipeline stage has no output layer")
    if getattr(layer, "gather_output", False):
        raise RuntimeError("the KL probe needs a vocab-parallel output layer "
                           "(parallel_output=True)")
    return layer


def _final_hidden(capture: _Capture, piece: ProbePiece, sequence_parallel: bool,
                  tp_group: dist.ProcessGroup | None, dual: bool) -> FinalHidden:
    """The captured ``[T(/tp), 1, h]`` input at the piece's counted positions."""
    hidden, tangent = fwAD.unpack_dual(capture.hidden)
    weight = capture.weight
    if dual and tangent is None:
        raise RuntimeError(LOST_TANGENT)
    if sequence_parallel:
        hidden = all_gather_first_dim(hidden, tp_group)
        if tangent is not None:
            tangent = all_gather_first_dim(tangent, tp_group)
    counted = piece.mask[0].nonzero().squeeze(1)
    return FinalHidden(
        hidden=hidden[:, 0].index_select(0, counted),
        tangent=None if tangent is None else tangent[:, 0].index_select(0, counted),
        weight=weight,
    )


def _chunked(forward: Callable[..., Any], rows: int) -> Callable[..., Any]:
    """An MLP's forward over the first (sequence) dimension in chunks of ``rows``: each rank
    chunks its own rows, so under sequence parallelism fc1 gathers and fc2 reduce-scatters the
    same rows on every rank, in rank order."""

    def chunked(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if hidden_states.shape[0] <= rows or args or kwargs.get("per_token_scale") is not None:
            return forward(hidden_states, *args, **kwargs)
        outputs, bias = [], None
        for start in range(0, hidden_states.shape[0], rows):
            output, bias = forward(hidden_states[start:start + rows], **kwargs)
            outputs.append(output)
        return torch.cat(outputs), bias

    return chunked


@contextmanager
def _chunked_mlps(model_chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Every dense decoder layer's MLP (an MoE layer's experts exchange tokens with other
    ranks, which must see the same calls, so they run whole) chunked for the probe's passes."""
    config = unwrap_model(model_chunks[0]).config
    tp = config.tensor_model_parallel_size
    gathered = tp if config.sequence_parallel and tp > 1 else 1
    rows = max(1, MLP_CHUNK_ELEMENTS * tp // (config.ffn_hidden_size * gathered))
    mlps = [module.mlp for chunk in model_chunks for module in unwrap_model(chunk).modules()
            if isinstance(getattr(module, "mlp", None), MLP)]
    try:
        for mlp in mlps:
            mlp.forward = _chunked(type(mlp).forward.__get__(mlp), rows)
        yield
    finally:
        for mlp in mlps:
            mlp.__dict__.pop("forward", None)


def run_pieces(
    model_chunks: Sequence[torch.nn.Module],
    pieces: Sequence[ProbePiece],
    consume: Callable[[int, FinalHidden], None],
    *,
    pipeline: PipelinePosition | None,
    targets: Sequence[SketchTarget] = (),
    directions: Mapping[str, LowRankDirection] | None = None,
    holds_output: bool,
) -> None:
    """Each piece through the model, one at a time (under :func:`probe_mode`: a forward-mode
    pass when ``directions`` are given, a plain one otherwise); on the ranks that hold the
    last stage (``holds_output``) ``consume(index, final_hidden)`` runs after each piece's
    forward, inside the pass (it may communicate over tensor parallelism). The pieces must be
    laid out for this layout (:func:`layout_pieces`): identical on every rank of the model.
    """
    config = unwrap_model(model_chunks[0]).config
    sequence_parallel = bool(config.sequence_parallel and config.tensor_model_parallel_size > 1)
    capture = _Capture()
    layer = _last_output_layer(model_chunks) if holds_output else None
    tp_group = layer.tp_group if layer is not None else None
    if pieces and layer is not None:
        _install_capture(layer, capture)
    dual = directions is not None
    try:
        with probe_mode(model_chunks, targets=targets, directions=directions), \
                _chunked_mlps(model_chunks):
            for index, piece in enumerate(pieces):
                staged_forward(model_chunks, piece.tokens, piece.position_ids,
                               pipeline=pipeline, dual=dual)
                if layer is None:
                    continue
                if capture.hidden is None:
                    raise RuntimeError("the output layer did not run in a probe forward")
                final = _final_hidden(capture, piece, sequence_parallel, tp_group, dual)
                capture.hidden = capture.weight = None
                consume(index, final)
    finally:
        if layer is not None:
            # The instance attribute shadowed the class's forward; removing it restores it.
            layer.__dict__.pop("forward", None)


def length_multiple(model_chunks: Sequence[torch.nn.Module]) -> int:
    """What every piece's length must divide by: the TP size under sequence parallelism."""
    config = unwrap_model(model_chunks[0]).config
    tp = config.tensor_model_parallel_size
    return tp if config.sequence_parallel and tp > 1 else 1


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _empty_piece(length: int, device: torch.device) -> ProbePiece:
    return ProbePiece(
        tokens=torch.zeros(1, length, dtype=torch.int64, device=device),
        position_ids=torch.arange(length, device=device)[None],
        mask=torch.zeros(1, length, dtype=torch.bool, device=device),
    )


def layout_pieces(batch: ProbeBatch, *, multiple: int, align_group: dist.ProcessGroup | None,
                  same_lengths: bool, device: torch.device) -> list[ProbePiece]:
    """This rank's pieces as the layout runs them, each padded (uncounted tokens after its own)
    to a multiple of ``multiple``. With ``align_group`` (the expert-parallel group, whose token
    dispatchers exchange every piece's tokens): as many pieces as the rank with the most (the
    others run uncounted pieces of ``multiple`` tokens), and with ``same_lengths`` (a dispatcher
    that all-gathers equal shares) the i-th piece as long as the longest i-th piece of the
    group."""
    lengths = [_round_up(piece.length, multiple) for piece in batch.pieces]
    if align_group is not None and dist.get_world_size(align_group) > 1:
        count = torch.tensor([len(lengths)], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=align_group)
        aligned = torch.full((int(count),), multiple, dtype=torch.int64, device=device)
        aligned[:len(lengths)] = torch.tensor(lengths, dtype=torch.int64)
        if same_lengths:
            dist.all_reduce(aligned, op=dist.ReduceOp.MAX, group=align_group)
        lengths = aligned.tolist()
    pieces = []
    for index, length in enumerate(lengths):
        if index < len(batch.pieces):
            pieces.append(batch.pieces[index].to(device).padded_to(length))
        else:
            pieces.append(_empty_piece(length, device))
    return pieces


def refuse_packed(pieces: Sequence[ProbePiece]) -> None:
    """Packed pieces need the packed attention of the packing work; until the model takes
    packed sequence parameters here, a piece holds one sequence."""
    if any(piece.cu_seqlens is not None for piece in pieces):
        raise ValueError(
            "a probe piece packs several sequences (cu_seqlens), but the probe's forward runs "
            "one sequence per piece; build the probe with one response per piece"
        )

