"""The step's rollouts as the policy update's microbatches, with the reference and "old"
log-probs every update on them needs -- packed (train.packing) or padded.

**Packed** (the rl default): every rank gathers the step's rollouts over data parallelism (token
ids and log-probs: small beside the model), plans the packs of the whole step
(:func:`megatron_logra.packing.plan_packs`, identical on every rank) and builds its own rows:
each sequence ``prompt + response`` minus its last token (which has no label) at its own
positions, side by side, with the per-sequence tensors of the loss (response mask, rollout
log-probs, advantages, completion) laid out exactly as in an unpacked microbatch
(``[sequences, longest]``), so the loss and its normalisation are the unpacked ones. The
reference-model and old-policy log-probs are forward-only passes over the same rows.

**Padded**: each rank's own responses padded to ``model.seq_length`` in microbatches of
``train.micro_batch_size`` (:mod:`.batching`).

Both report ``microbatches`` (per DP rank), ``padding_fraction`` (padding / processed tokens,
all ranks) and ``processed_tokens`` for the step record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_logra.config import Config
from megatron_logra.mcore import (
    ParallelGroups,
    compute_packed_token_logprobs,
    compute_token_logprobs,
)
from megatron_logra.packing import Pack, PackPlan, RowLayout, pack_row, plan_packs, unpack_row
from megatron_logra.packing.plan import layout_multiples
from megatron_logra.rl.rollout import PaddedRollout, RolloutBatch
from megatron_logra.train.rl.batching import RLMicrobatch, pad_to_length, rl_microbatches
from megatron_logra.train.rl.collectives import gather_dp
from megatron_logra.train.rl.rollouts import ScoredRollouts


@dataclass(frozen=True)
class UpdateBatches:
    """This rank's microbatches of the step and what the schedule needs to know of them."""

    microbatches: list[RLMicrobatch]
    seq_length: int
    """The sequence length Megatron's schedule is given (a packed row's, one per step under
    pipeline parallelism)."""
    micro_batch_size: int
    temperature: float
    processed_tokens: int
    """Tokens the update runs the model on, over all DP ranks, padding included."""
    real_tokens: int
    """Positions with a label (prompt + response - 1 per sequence), over all DP ranks."""
    sequences: list[tuple[int, ...]]
    """Global indices of each microbatch's sequences (rows of its per-sequence tensors)."""

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.processed_tokens

    def metrics(self) -> dict[str, Any]:
        return {"microbatches": len(self.microbatches),
                "padding_fraction": self.padding_fraction,
                "processed_tokens": self.processed_tokens}


def update_batches(
    cfg: Config, scored: ScoredRollouts, *, pad_id: int, groups: ParallelGroups,
    policy: Sequence[torch.nn.Module], reference: Sequence[torch.nn.Module] | None,
    vocab_size: int,
) -> UpdateBatches:
    """The update's microbatches of ``scored`` (this rank's rollouts), with the reference
    model's log-probs when ``reference`` is given and the policy's own when
    rl.updates_per_rollout > 1."""
    build = _packed if cfg.train.packing.enabled else _padded
    return build(cfg, scored, pad_id=pad_id, groups=groups, policy=policy, reference=reference,
                 vocab_size=vocab_size)


def _labelled_tokens(rollout: RolloutBatch) -> list[int]:
    """Per sequence: prompt + response - 1 positions (the last token predicts nothing)."""
    return [len(prompt) + int(length) - 1
            for prompt, length in zip(rollout.prompt_tokens, rollout.response_lengths,
                                      strict=True)]


def _padded(cfg: Config, scored: ScoredRollouts, *, pad_id: int, groups: ParallelGroups,
            policy: Sequence[torch.nn.Module], reference: Sequence[torch.nn.Module] | None,
            vocab_size: int) -> UpdateBatches:
    mbs, seq_length = cfg.train.micro_batch_size, cfg.model.seq_length
    padded = pad_to_length(scored.rollout, seq_length, pad_id)

    def logprobs(chunks: Sequence[torch.nn.Module]) -> torch.Tensor:
        return compute_token_logprobs(
            chunks, padded.tokens, padded.labels, temperature=padded.logprob_temperature,
            vocab_size=vocab_size, groups=groups, micro_batch_size=mbs,
        ).cpu()

    reference_logprobs = logprobs(reference) if reference is not None else None
    # The GRPO ratio's "old" policy: the trainer's own log-probs before the first update.
    old_logprobs = logprobs(policy) if cfg.rl.updates_per_rollout > 1 else None
    microbatches = rl_microbatches(padded, scored.advantages, reference_logprobs,
                                   micro_batch_size=mbs, device=groups.device,
                                   old_logprobs=old_logprobs)
    # The CP ranks of a replica hold the same sequences (gathered over DP x CP: cp copies).
    real = sum(gather_dp([sum(_labelled_tokens(scored.rollout))], groups)) // groups.cp_size
    share = scored.rollout.sequence_indices
    return UpdateBatches(microbatches=microbatches, seq_length=seq_length, micro_batch_size=mbs,
                         temperature=padded.logprob_temperature,
                         processed_tokens=len(scored.lengths) * seq_length, real_tokens=real,
                         sequences=[tuple(share[i:i + mbs]) for i in range(0, len(share), mbs)])


def _packed(cfg: Config, scored: ScoredRollouts, *, pad_id: int, groups: ParallelGroups,
            policy: Sequence[torch.nn.Module], reference: Sequence[torch.nn.Module] | None,
            vocab_size: int) -> UpdateBatches:
    rollout, advantages = gather_step_rollouts(scored, groups)
    padded = rollout.to_padded(pad_id)
    if padded.tokens.shape[1] > cfg.model.seq_length:
        # The model's positions (and the unpacked path) stop at model.seq_length.
        raise ValueError(
            f"a prompt plus its response takes {padded.tokens.shape[1]} tokens, more than "
            f"model.seq_length={cfg.model.seq_length}; raise model.seq_length or lower "
            "rl.sampling.max_new_tokens"
        )
    plan = step_plan(cfg, _labelled_tokens(rollout), groups)
    microbatches = packed_microbatches(plan, groups.data_rank, padded, advantages, pad_id=pad_id,
                                       device=groups.device)

    def logprobs(chunks: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
        rows = compute_packed_token_logprobs(chunks, microbatches,
                                             temperature=padded.logprob_temperature,
                                             vocab_size=vocab_size, groups=groups)
        return [unpack_row(row, batch.layout, index=batch.gather)
                for row, batch in zip(rows, microbatches, strict=True)]

    if reference is not None:
        microbatches = [dataclasses.replace(batch, reference_logprobs=values)
                        for batch, values in zip(microbatches, logprobs(reference), strict=True)]
    if cfg.rl.updates_per_rollout > 1:
        microbatches = [dataclasses.replace(batch, old_logprobs=values)
                        for batch, values in zip(microbatches, logprobs(policy), strict=True)]
    return UpdateBatches(microbatches=microbatches, seq_length=plan.row_length,
                         micro_batch_size=1, temperature=padded.logprob_temperature,
                         processed_tokens=plan.processed_tokens, real_tokens=plan.real_tokens,
                         sequences=[pack.indices for pack in plan.ranks[groups.data_rank]])


def gather_step_rollouts(scored: ScoredRollouts, groups: ParallelGroups
                         ) -> tuple[RolloutBatch, torch.Tensor]:
    """The whole step's rollouts and advantages on every rank, in global order (each DP rank
    generated its own contiguous share; the CP ranks of a replica hold the same share, so one
    copy of each is kept)."""
    parts = [(rollout, values) for cp_rank, rollout, values in gather_dp(
        [(groups.cp_rank, scored.rollout, scored.advantages)], groups) if cp_rank == 0]
    rollout = RolloutBatch.merged([part for part, _ in parts])
    advantages = torch.cat([values for _, values in parts])
    if rollout.sequence_indices != tuple(range(len(advantages))):
        raise RuntimeError(
            f"the data-parallel ranks' rollouts hold sequences {rollout.sequence_indices[:8]}..."
            f" for {len(advantages)} advantages: each rank must generate its contiguous share"
        )
    return rollout, advantages


def step_plan(cfg: Config, lengths: Sequence[int], groups: ParallelGroups) -> PackPlan:
    """The packs of a step's sequences of ``lengths`` tokens, for this run's layout."""
    packing, p = cfg.train.packing, cfg.parallel
    sequence_multiple, row_multiple = layout_multiples(p.tp, p.sp, p.cp)
    return plan_packs(lengths, max_tokens=packing.max_tokens_per_microbatch,
                      dp_size=groups.data_size, algorithm=packing.algorithm,
                      sequence_multiple=sequence_multiple, row_multiple=row_multiple,
                      microbatch_multiple=groups.pp_size if groups.vpp_size > 1 else 1,
                      uniform_rows=groups.pp_size > 1)


def packed_microbatches(plan: PackPlan, dp_rank: int, padded: PaddedRollout,
                        advantages: torch.Tensor, *, pad_id: int, device: torch.device
                        ) -> list[RLMicrobatch]:
    """Data-parallel rank ``dp_rank``'s packed rows of a step whose sequences ``padded``
    (global order) holds."""
    return [_packed_microbatch(pack, padded, advantages, pad_id=pad_id, device=device)
            for pack in plan.ranks[dp_rank]]


def _packed_microbatch(pack: Pack, padded: PaddedRollout, advantages: torch.Tensor, *,
                       pad_id: int, device: torch.device) -> RLMicrobatch:
    layout = RowLayout.of(pack)
    index = list(pack.indices)
    width = max(layout.longest, 1)

    def row(values: torch.Tensor) -> torch.Tensor:
        return pack_row([values[i, :length] for i, length in zip(index, pack.lengths,
                                                                 strict=True)],
                        layout, pad_id).to(device)

    def per_sequence(values: torch.Tensor) -> torch.Tensor:
        # An empty pack (never at rl's batch sizes) holds one placeholder sequence that counts
        # nowhere.
        chosen = (values[torch.tensor(index, dtype=torch.int64)] if index
                  else torch.zeros((1, *values.shape[1:]), dtype=values.dtype))
        return (chosen[:, :width] if chosen.dim() > 1 else chosen).to(device)

    return RLMicrobatch(
        tokens=row(padded.tokens), labels=row(padded.labels),
        position_ids=layout.position_ids().to(device),
        response_mask=per_sequence(padded.response_mask),
        rollout_logprobs=per_sequence(padded.rollout_logprobs), reference_logprobs=None,
        advantages=per_sequence(advantages), finished=per_sequence(padded.finished),
        layout=layout, gather=tuple(t.to(device) for t in layout.gather_index()),
    )
