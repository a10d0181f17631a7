"""From one step's rollouts to the trainer's microbatches and the KL probe.

The rollout engine returns ragged prompts and responses; the trainer needs fixed shapes for the
pipeline schedules: every sequence padded to ``model.seq_length`` (a multiple of TP under
sequence parallelism), cut into this DP rank's microbatches with the per-token quantities the
loss needs (rollout log-probs, advantages, response mask, completion flags).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from megatron_logra.packing.rows import RowLayout
from megatron_logra.rl.rollout import PaddedRollout, RolloutBatch


@dataclass(frozen=True)
class RLMicrobatch:
    """One microbatch of the policy update (``[b, s]`` tensors on the device, ``[b]`` for the
    per-response ones; packed: see ``layout``)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    reference_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    finished: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    """The trainer's log-probs before the first update on this batch (rl.updates_per_rollout
    > 1); None: the ratio is taken against the current log-probs."""
    layout: RowLayout | None = None
    """A packed microbatch (train.packing): ``tokens``, ``labels`` and ``position_ids`` are one
    ``[1, T]`` row holding several sequences, laid out as this says; every other tensor is per
    sequence (``[N, L]``, ``[N]``), as in an unpacked microbatch. None: unpacked."""
    gather: tuple[torch.Tensor, torch.Tensor] | None = None
    """The layout's gather index (RowLayout.gather_index) on the device."""

    per_sequence_fields: ClassVar[tuple[str, ...]] = (
        "response_mask", "rollout_logprobs", "reference_logprobs", "old_logprobs")
    """The ``[N, L]`` per-sequence fields of a packed microbatch (context_parallel.split_batch
    splits them per sequence, the row fields along the row)."""


def pad_to_length(rollout: RolloutBatch, length: int, pad_id: int) -> PaddedRollout:
    """The trainer's view of the rollout, padded to ``length`` (= model.seq_length: fixed shapes
    for the pipeline schedules; a multiple of TP under sequence parallelism)."""
    padded = rollout.to_padded(pad_id)
    if padded.tokens.shape[1] > length:
        raise ValueError(
            f"a prompt plus its response takes {padded.tokens.shape[1]} tokens, more than "
            f"model.seq_length={length}; raise model.seq_length or lower "
            "rl.sampling.max_new_tokens"
        )
    extra = length - padded.tokens.shape[1]

    def widen(tensor: torch.Tensor, value: float | int | bool) -> torch.Tensor:
        return torch.nn.functional.pad(tensor, (0, extra), value=value)

    return PaddedRollout(
        tokens=widen(padded.tokens, pad_id),
        labels=widen(padded.labels, pad_id),
        position_ids=torch.arange(length, dtype=torch.int64)[None, :].repeat(len(rollout), 1),
        response_mask=widen(padded.response_mask, False),
        rollout_logprobs=widen(padded.rollout_logprobs, 0.0),
        sampling_logprobs=widen(padded.sampling_logprobs, 0.0),
        prompt_lengths=padded.prompt_lengths,
        response_lengths=padded.response_lengths,
        finished=padded.finished,
        logprob_temperature=padded.logprob_temperature,
    )


def rl_microbatches(
    padded: PaddedRollout,
    advantages: torch.Tensor,
    reference_logprobs: torch.Tensor | None,
    *,
    micro_batch_size: int,
    device: torch.device,
    old_logprobs: torch.Tensor | None = None,
) -> list[RLMicrobatch]:
    """This rank's padded responses in microbatches of ``micro_batch_size``."""
    microbatches = []
    for lo in range(0, padded.tokens.shape[0], micro_batch_size):
        rows = slice(lo, lo + micro_batch_size)
        microbatches.append(RLMicrobatch(
            tokens=padded.tokens[rows].to(device), labels=padded.labels[rows].to(device),
            position_ids=padded.position_ids[rows].to(device),
            response_mask=padded.response_mask[rows].to(device),
            rollout_logprobs=padded.rollout_logprobs[rows].to(device),
            reference_logprobs=(reference_logprobs[rows].to(device)
                                if reference_logprobs is not None else None),
            advantages=advantages[rows].to(device), finished=padded.finished[rows].to(device),
            old_logprobs=old_logprobs[rows].to(device) if old_logprobs is not None else None,
        ))
    return microbatches
