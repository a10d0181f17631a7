"""The probe's KL sums, piece by piece, and their one reduction over the ranks.

:func:`predicted_sums` runs the forward-mode pass over the pieces (:mod:`.stream`) and reduces
each output-layer chunk at once into the piece's Fisher-form sum (``megatron_logra.kl``, float64,
vocab-parallel); it keeps, for the realised KL, what recomputes the pre-update logits exactly
(:class:`KeptLogits`). :func:`realised_sums` runs a plain pass after the update and reduces
``KL(old || new)`` chunk by chunk from what was kept. Nothing ``[tokens x vocab]``-sized is
alive: one chunk's logits and tangent (or old and new logits) at a time.

The realised KL's scheme, exact: the pre-update logits at a counted position are
``h_old W_old^T`` (the output layer's input before the update, times its weight then). The
pass keeps ``h_old`` at the counted positions (``[N, h]`` per piece, the model's dtype) and --
only when the output weight itself can change (it trains: library mode, not paper mode, whose
non-targets are frozen) -- a copy of this rank's output weight shard. After the update the old
logits are recomputed chunk by chunk with the same arithmetic as the first pass, so the
realised KL is computed from the same pre-update logits the old scheme kept whole (to the
rounding of a matmul over a different set of rows).

:func:`probe_token_mean` is the only place the sums cross ranks: one all-reduce over an explicit
group of every rank of the run, to which the ranks holding the output (the last pipeline
stage) of tensor-parallel rank 0 contribute -- every data-parallel replica's sums, counted
once; context parallelism would add its ranks' partial sums here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_logra.kl import TokenSum, exact_kl_vocab_parallel, predicted_kl_vocab_parallel
from megatron_logra.mcore.kl_probe.logit_jvp import LowRankDirection, PipelinePosition
from megatron_logra.mcore.kl_probe.stream import FinalHidden, output_layer_chunks, run_pieces
from megatron_logra.mcore.models.targets import SketchTarget
from megatron_logra.probe_batch import ProbePiece


@dataclass(frozen=True)
class KLSettings:
    """What turns logits into a KL: the sampling temperature, the tensor-parallel group of the
    vocabulary shards, the unpadded vocabulary."""

    temperature: float
    tp_group: dist.ProcessGroup
    vocab_size: int


@dataclass
class KeptLogits:
    """What recomputes the pre-update logits of every piece (see the module docstring)."""

    hidden: list[torch.Tensor]
    """``[N_i, h]`` per piece: the output layer's input at its counted positions."""
    weight: torch.Tensor | None
    """A copy of the output weight shard when it trains; None: the weight cannot change."""

    @property
    def bytes(self) -> int:
        held = sum(h.numel() * h.element_size() for h in self.hidden)
        return held + (0 if self.weight is None else self.weight.numel()
                       * self.weight.element_size())


def _zero(device: torch.device) -> TokenSum:
    zero = torch.zeros((), dtype=torch.float64, device=device)
    return TokenSum(total=zero, count=zero.clone())


def _add(a: TokenSum, b: TokenSum) -> TokenSum:
    return TokenSum(total=a.total + b.total, count=a.count + b.count)


def predicted_sums(
    model_chunks: Sequence[torch.nn.Module],
    pieces: Sequence[ProbePiece],
    *,
    targets: Sequence[SketchTarget],
    directions: Mapping[str, LowRankDirection],
    kl: KLSettings,
    pipeline: PipelinePosition | None,
    holds_output: bool,
    keep: bool,
) -> tuple[list[TokenSum], KeptLogits | None]:
    """Each piece's sum of ``m_t = 1/2 Var_p(dz / T)`` over its counted positions (on the ranks
    holding the output; empty elsewhere), and -- with ``keep`` -- what the realised KL needs."""
    sums: list[TokenSum] = []
    kept = KeptLogits(hidden=[], weight=None) if keep and holds_output else None

    def consume(index: int, final: FinalHidden) -> None:
        del index
        total = _zero(final.hidden.device)
        for logits, tangent in output_layer_chunks(final):
            total = _add(total, predicted_kl_vocab_parallel(
                logits, tangent, temperature=kl.temperature, tp_group=kl.tp_group,
                vocab_size=kl.vocab_size, chunk_positions=logits.shape[0]))
        sums.append(total)
        if kept is not None:
            kept.hidden.append(final.hidden)
            if kept.weight is None and final.weight.requires_grad:
                kept.weight = final.weight.detach().clone()

    run_pieces(model_chunks, pieces, consume, pipeline=pipeline, targets=targets,
               directions=directions, holds_output=holds_output)
    return sums, kept


def realised_sums(
    model_chunks: Sequence[torch.nn.Module],
    pieces: Sequence[ProbePiece],
    kept: KeptLogits | None,
    *,
    kl: KLSettings,
    pipeline: PipelinePosition | None,
    holds_output: bool,
) -> list[TokenSum]:
    """Each piece's sum of ``KL(old || new)`` over its counted positions after the update, the
    old logits recomputed from ``kept`` (the same pieces as :func:`predicted_sums`')."""
    if holds_output and kept is None:
        raise RuntimeError("the realised KL needs what the prediction kept of the old logits")
    sums: list[TokenSum] = []

    def consume(index: int, final: FinalHidden) -> None:
        old = FinalHidden(hidden=kept.hidden[index], tangent=None, weight=final.weight)
        total = _zero(final.hidden.device)
        pairs = zip(output_layer_chunks(old, weight=kept.weight), output_layer_chunks(final),
                    strict=True)
        for (before, _), (after, _) in pairs:
            total = _add(total, exact_kl_vocab_parallel(
                before, after, temperature=kl.temperature, tp_group=kl.tp_group,
                vocab_size=kl.vocab_size, chunk_positions=before.shape[0]))
        sums.append(total)

    run_pieces(model_chunks, pieces, consume, pipeline=pipeline, holds_output=holds_output)
    return sums


def probe_token_mean(sums: Sequence[TokenSum], *, contributes: bool,
                     group: dist.ProcessGroup, device: torch.device, what: str) -> float:
    """Token mean over every rank's pieces: one all-reduce of (total, count) over ``group``,
    to which only the ranks with ``contributes`` add their sums (the others add zeros: every
    tensor-parallel rank holds the same vocabulary-reduced sums, and only the last pipeline
    stage has them)."""
    both = torch.zeros(2, dtype=torch.float64, device=device)
    if contributes:
        for piece in sums:
            both[0] += piece.total
            both[1] += piece.count
    dist.all_reduce(both, group=group)
    if both[1] <= 0:
        raise RuntimeError(f"no probe tokens on any rank to measure the {what} KL")
    return float(both[0] / both[1])
