"""The policy-update phase of an RL step: the policy loss through Megatron's schedule, then one
optimizer step (with the KL step control, fed this step's probe and rollout/trainer gap).

Each microbatch returns its loss in Megatron's per-token convention (sum and token count;
``finalize_model_grads`` divides by the global count) and a :class:`LossSums` report of detached
sums, added over microbatches and then over the data-parallel replicas.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_logra.context_parallel import split_batch
from megatron_logra.mcore import (
    ParallelGroups,
    TrainingSetup,
    forward_backward,
    packed_seq_params,
    token_logprobs_from_logits,
)
from megatron_logra.packing import unpack_row
from megatron_logra.probe_batch import ProbeBatch
from megatron_logra.rl.losses import rollout_gap_max, rollout_mismatch_sums
from megatron_logra.rl.presets import PolicyLoss
from megatron_logra.train.rl.batching import RLMicrobatch
from megatron_logra.train.rl.collectives import replica_max, replica_sum, world_max


@dataclass(frozen=True)
class LossSums:
    """Sums over a batch's valid response tokens (float64 while they travel)."""

    loss_sum: float
    tokens: float
    ratio_sum: float
    """The loss's ratio (importance weight or clipped-surrogate ratio)."""
    gap_sum: float
    """``log pi_rollout - log pi_trainer`` over completed responses (the KL controller's
    mismatch input)."""
    gap_tokens: float
    all_gap_sum: float
    """The same gap over every generated token: a direct check that the sampler and the
    trainer agree on the policy."""
    all_gap_tokens: float
    clipped_tokens: float
    """Tokens whose clipped surrogate term was selected (no gradient; GRPO), else 0."""
    reference_kl_sum: float
    """The k3 estimate of KL(pi_trainer || pi_reference) over the valid tokens (GRPO with a
    reference model; the loss adds it times rl.loss.grpo.kl_beta), else 0."""
    weight_sum: float
    """The off-policy correction's weights (megatron_logra.rl.off_policy), 0 without one."""
    raw_ratio_sum: float
    """Its raw ratios ``pi_trainer / pi_rollout`` before truncation or masking."""
    truncated_tokens: float
    """Tokens whose weight is not their raw ratio (truncated or masked)."""

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, f.name) for f in dataclasses.fields(self)],
                            dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> LossSums:
        return cls(*values.tolist())

    @staticmethod
    def stack(*values: torch.Tensor) -> torch.Tensor:
        """The tensor form of a report built inside a loss function (field order)."""
        return torch.stack([value.double() for value in values])


@dataclass(frozen=True)
class PolicyUpdate:
    sums: LossSums
    grad_norm: float | None
    gap_max: float = 0.0
    """The largest ``|log pi_rollout - log pi_trainer|`` over every generated token."""
    ratio_max: float = 0.0
    """The largest raw importance ratio of the batch (0 without a correction)."""

    @property
    def mismatch(self) -> float | None:
        """Mean rollout/trainer gap over completed responses (None: none completed)."""
        return self.sums.gap_sum / self.sums.gap_tokens if self.sums.gap_tokens else None


def _forward_step(
    data_iterator: Iterator[RLMicrobatch], model: torch.nn.Module, *, loss: PolicyLoss,
    vocab_size: int, tp_rank: int, temperature: float,
) -> tuple[Any, Any]:
    batch = next(data_iterator)
    packed = (packed_seq_params(batch.layout, batch.tokens.device)
              if batch.layout is not None else None)
    output = model(batch.tokens, batch.position_ids, None, packed_seq_params=packed)

    def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        logprobs = token_logprobs_from_logits(logits, batch.labels, temperature=temperature,
                                              vocab_size=vocab_size, tp_rank=tp_rank)
        if batch.layout is not None:
            # The packed row's log-probs per sequence: the loss sees an unpacked microbatch.
            logprobs = unpack_row(logprobs, batch.layout, index=batch.gather)
        token_loss, ratio_sum = loss(
            logprobs, rollout_logprobs_BL=batch.rollout_logprobs, advantages_B=batch.advantages,
            response_mask_BL=batch.response_mask, reference_logprobs_BL=batch.reference_logprobs,
            old_logprobs_BL=batch.old_logprobs,
        )
        gap = rollout_mismatch_sums(logprobs.detach(), batch.rollout_logprobs,
                                    batch.response_mask, batch.finished)
        every = rollout_mismatch_sums(logprobs.detach(), batch.rollout_logprobs,
                                      batch.response_mask, torch.ones_like(batch.finished))
        report = LossSums.stack(
            token_loss.loss_sum.detach(), token_loss.num_tokens, ratio_sum,
            gap.gap_sum, torch.as_tensor(gap.num_tokens, dtype=torch.float64),
            every.gap_sum, torch.as_tensor(every.num_tokens, dtype=torch.float64),
            token_loss.metrics.get("clipped_count", torch.zeros((), dtype=torch.float64)),
            token_loss.metrics.get("kl_sum", torch.zeros((), dtype=torch.float64)),
            *(token_loss.metrics.get(key, torch.zeros((), dtype=torch.float64)) for key in (
                "importance_weight_sum", "importance_ratio_sum", "truncated_count")),
        )
        gap_max = rollout_gap_max(logprobs.detach(), batch.rollout_logprobs, batch.response_mask)
        ratio_max = token_loss.metrics.get("importance_ratio_max",
                                           torch.zeros((), dtype=torch.float64))
        return token_loss.loss_sum, token_loss.num_tokens.to(torch.int), {
            "rl": report, "rl_gap_max": gap_max, "ratio_max": ratio_max.double().reshape(1)}

    return output, loss_func


def update_policy(
    setup: TrainingSetup,
    microbatches: list[RLMicrobatch],
    loss: PolicyLoss,
    *,
    probe: ProbeBatch | None,
    seq_length: int,
    micro_batch_size: int,
    vocab_size: int,
    temperature: float,
    groups: ParallelGroups,
    observe_mismatch: bool = True,
) -> PolicyUpdate:
    """One policy update on this rank's microbatches (every DP rank passes its own); ``probe``
    is this rank's part of the KL probe set when the optimizer has a KL step control.

    ``observe_mismatch``: feed this update's rollout/trainer gap to the KL controller (the
    first update on a rollout batch; after it the gap also holds the policy's own movement).
    """
    for chunk in setup.model_chunks:
        chunk.zero_grad_buffer()
    setup.optimizer.zero_grad()
    forward_step = functools.partial(_forward_step, loss=loss, vocab_size=vocab_size,
                                     tp_rank=groups.tp_rank, temperature=temperature)
    # Under context parallelism each rank takes its chunks of every sequence; the loss and
    # report sums are over its tokens (finalize_model_grads and replica_sum add the CP ranks').
    microbatches = [split_batch(batch, groups.cp_rank, groups.cp_size) for batch in microbatches]
    reports = forward_backward(setup.model_chunks, microbatches, forward_step,
                               seq_length=seq_length, micro_batch_size=micro_batch_size)
    local = torch.zeros(len(dataclasses.fields(LossSums)), dtype=torch.float64,
                        device=groups.device)
    gap_max = torch.zeros((), dtype=torch.float64, device=groups.device)
    ratio_max = torch.zeros(1, dtype=torch.float64, device=groups.device)
    for report in reports:
        local += report["rl"].to(groups.device)
        gap_max = torch.maximum(gap_max, report["rl_gap_max"].to(groups.device))
        ratio_max = torch.maximum(ratio_max, report["ratio_max"].to(groups.device))
    sums = LossSums.from_tensor(replica_sum(local, groups))
    # The sums are the same on every rank (summed over the world): all refuse together, after
    # backward filled the sketches and grads (zeroed by the next step) but before any step.
    if not (math.isfinite(sums.loss_sum) and math.isfinite(sums.ratio_sum)):
        raise RuntimeError(
            f"non-finite policy loss (sum {sums.loss_sum}, ratio sum {sums.ratio_sum} over "
            f"{sums.tokens:.0f} tokens) at optimizer step {setup.scheduler.num_steps + 1}; the "
            "optimizer was not stepped: no weight was changed"
        )
    update = PolicyUpdate(sums=sums, grad_norm=None, gap_max=world_max(gap_max),
                          ratio_max=float(replica_max(ratio_max, groups)[0]))
    control = setup.kl_control
    if control is not None:
        if observe_mismatch:
            # None (no completed, valid response): the controller keeps its EMA and uses the
            # unreduced budget, as the paper's does.
            control.observe_mismatch(update.mismatch)
        if probe is None:
            raise RuntimeError("the optimizer has a KL step control: give update_policy a probe")
        control.set_batch(probe)
    success, grad_norm, _ = setup.optimizer.step()
    if not success:
        raise RuntimeError(f"optimizer step {setup.scheduler.num_steps + 1} reported failure")
    setup.scheduler.step(1)
    return dataclasses.replace(update, grad_norm=float(grad_norm) if grad_norm is not None
                               else None)
