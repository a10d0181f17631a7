"""Per-token log-probs of given tokens under a Megatron GPT: the trainer's side of the rollout
contract (``megatron_logra.rl.rollout``).

``log pi(y_t) = log softmax(z_t / T)[y_t]`` over the real vocabulary, with T the rollout's
``logprob_temperature``: exactly the quantity the rollout engine reports as ``logprobs``, so the
importance weight ``pi_train / pi_rollout`` compares like with like.

The log-softmax is computed on this rank's vocabulary shard (what Megatron's output layer
produces with ``parallel_output=True``) by Megatron's own vocab-parallel cross entropy: an
all-reduce (max) of the logit maxima and all-reduces (sum) of the partition function and the
target logit over the tensor-parallel group, never gathering the vocabulary; its backward is
Megatron's fused ``softmax - onehot``. Vocabulary padding (ids at and beyond ``vocab_size``) is
given logit -inf first, so it has probability zero exactly as in the sampler, which never
samples it.

* :func:`token_logprobs_from_logits` is the per-token quantity inside a training loss function
  (it keeps the autograd graph).
* :func:`compute_token_logprobs` runs a forward-only pass over a batch through Megatron's
  pipeline schedule (TP, SP, PP, VPP) and returns the log-probs on every rank;
  :func:`compute_packed_token_logprobs` does the same for packed rows
  (``megatron_logra.packing``).

Shape suffixes: B = sequences, L = positions, V = this rank's vocabulary shard.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from megatron_logra.context_parallel import gather_packed_row, gather_sequence, split_batch
from megatron_logra.mcore.models.packed_attention import packed_seq_params
from megatron_logra.mcore.models.sharding import unwrap_model
from megatron_logra.mcore.process_groups import ParallelGroups
from megatron_logra.mcore.training.forward_backward import forward_backward


def _check_temperature(temperature: float) -> None:
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"temperature={temperature!r} must be a finite positive number: the rollout batch's "
            "logprob_temperature (1 for greedy rollouts)"
        )


def token_logprobs_from_logits(
    logits_shard_BLV: torch.Tensor,
    labels_BL: torch.Tensor,
    *,
    temperature: float,
    vocab_size: int,
    tp_rank: int,
) -> torch.Tensor:
    """float32 ``[B, L]``: ``log softmax(z / T)[labels]`` from this rank's vocabulary shard.

    Every rank of the tensor-parallel group must call it with the same labels (it all-reduces
    over Megatron's TP group, the group the output layer split the vocabulary over); each gets
    the full-vocabulary result. Differentiable with respect to the logits.

    Args:
        logits_shard_BLV: ``[B, L, V_local]`` logits of rank ``tp_rank``'s vocabulary shard
            (Megatron's layout: rank r owns ids ``[r * V_local, (r + 1) * V_local)``).
        labels_BL: int64 ``[B, L]`` token ids in ``[0, vocab_size)``.
        temperature: T (> 0).
        vocab_size: the real (tokenizer) vocabulary; the model's padded ids beyond it get -inf.
        tp_rank: this rank's index in the tensor-parallel group.
    """
    _check_temperature(temperature)
    if logits_shard_BLV.dim() != 3 or labels_BL.shape != logits_shard_BLV.shape[:2]:
        raise ValueError(
            f"logits {tuple(logits_shard_BLV.shape)} must be [B, L, V_local] and labels "
            f"{tuple(labels_BL.shape)} must be [B, L]"
        )
    if labels_BL.numel() and (labels_BL.min() < 0 or labels_BL.max() >= vocab_size):
        raise ValueError(
            f"labels must be token ids in [0, vocab_size={vocab_size}); got values in "
            f"[{int(labels_BL.min())}, {int(labels_BL.max())}] (pad with a real token id)"
        )
    width = logits_shard_BLV.shape[-1]
    columns_V = torch.arange(tp_rank * width, (tp_rank + 1) * width, device=labels_BL.device)
    # A fresh float32 tensor: Megatron's cross entropy shifts its input in place.
    scaled_BLV = (logits_shard_BLV.float() / temperature).masked_fill(
        columns_V >= vocab_size, -math.inf
    )
    return -vocab_parallel_cross_entropy(scaled_BLV, labels_BL)


@dataclass(frozen=True)
class _Microbatch:
    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: PackedSeqParams | None = None
    layout: Any = None
    """A packed row's RowLayout (this CP rank's share of it under context parallelism)."""


def _forward_step(
    data_iterator: Iterator[_Microbatch],
    model: torch.nn.Module,
    *,
    temperature: float,
    vocab_size: int,
    tp_rank: int,
) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    output = model(batch.tokens, batch.position_ids, None,
                   packed_seq_params=batch.packed_seq_params)

    def collect(output_tensor: torch.Tensor, non_loss_data: bool = False) -> torch.Tensor:
        if not non_loss_data:
            raise RuntimeError("compute_token_logprobs runs the schedule with collect_non_loss_data")
        return token_logprobs_from_logits(
            output_tensor, batch.labels, temperature=temperature, vocab_size=vocab_size,
            tp_rank=tp_rank,
        )

    return output, collect


def compute_token_logprobs(
    model_chunks: Sequence[torch.nn.Module],
    tokens_BL: torch.Tensor,
    labels_BL: torch.Tensor,
    *,
    temperature: float,
    vocab_size: int,
    groups: ParallelGroups,
    micro_batch_size: int,
    position_ids_BL: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 ``[B, L]`` log-probs of ``labels`` given ``tokens`` (causal), on every rank (on its
    device).

    A forward-only pass (no autograd graph, modules in eval mode for its duration) through
    Megatron's forward/backward schedule, so it works under every layout the trainer runs:
    the pipeline stages exchange activations as in training and the last stage's result is
    broadcast over the pipeline group. Collective over the model-parallel group; data-parallel
    ranks pass their own sequences. Under context parallelism every CP rank of a replica passes
    the same sequences, computes its own chunks and gathers the rest over the CP group.

    Args:
        model_chunks: this rank's model chunks (one per virtual pipeline stage), possibly wrapped
            in DDP / Float16Module.
        tokens_BL, labels_BL: int64 ``[B, L]`` (e.g. ``PaddedRollout.tokens`` / ``.labels``).
            Under sequence parallelism L must be a multiple of the TP size.
        temperature: the rollout's ``logprob_temperature``.
        vocab_size: the real (tokenizer) vocabulary size.
        groups: this rank's process groups.
        micro_batch_size: sequences per forward; must divide B.
        position_ids_BL: default ``0..L-1`` in every row.
    """
    _check_temperature(temperature)
    if tokens_BL.dim() != 2 or labels_BL.shape != tokens_BL.shape:
        raise ValueError(
            f"tokens {tuple(tokens_BL.shape)} and labels {tuple(labels_BL.shape)} must both be "
            "[B, L]"
        )
    size, length = tokens_BL.shape
    if size == 0 or length == 0:
        raise ValueError(f"tokens {tuple(tokens_BL.shape)} must hold at least one position")
    if micro_batch_size < 1 or size % micro_batch_size:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} must be >= 1 and divide the batch of {size} "
            "sequences"
        )
    if not model_chunks:
        raise ValueError("model_chunks is empty")
    model = unwrap_model(model_chunks[0])
    config = model.config
    if config.sequence_parallel and length % groups.tp_size:
        raise ValueError(
            f"sequence length {length} must be a multiple of the TP size {groups.tp_size} under "
            "sequence parallelism; pad with RolloutBatch.to_padded(pad_to_multiple_of=tp)"
        )
    if groups.cp_size > 1 and length % (
            2 * groups.cp_size * (groups.tp_size if config.sequence_parallel else 1)):
        raise ValueError(
            f"sequence length {length} must split into 2 * cp = {2 * groups.cp_size} equal "
            "chunks (of a multiple of TP under sequence parallelism); pad it to model.seq_length"
        )
    if model.position_embedding_type == "learned_absolute" and length > model.max_sequence_length:
        raise ValueError(
            f"sequence length {length} exceeds the model's learned positions "
            f"(model.seq_length={model.max_sequence_length}); generate fewer tokens or raise "
            "model.seq_length"
        )
    num_microbatches = size // micro_batch_size
    if groups.vpp_size > 1 and num_microbatches % groups.pp_size:
        raise ValueError(
            f"the interleaved schedule needs the number of microbatches ({num_microbatches} = "
            f"{size} sequences / micro_batch_size {micro_batch_size}) to be a multiple of "
            f"parallel.pp={groups.pp_size}"
        )
    device = groups.device
    if position_ids_BL is None:
        position_ids_BL = torch.arange(length, dtype=torch.int64)[None, :].expand(size, length)
    microbatches = [
        split_batch(_Microbatch(
            tokens=tokens_BL[start : start + micro_batch_size].to(device),
            labels=labels_BL[start : start + micro_batch_size].to(device),
            position_ids=position_ids_BL[start : start + micro_batch_size].contiguous().to(device),
        ), groups.cp_rank, groups.cp_size)
        for start in range(0, size, micro_batch_size)
    ]
    return torch.cat(_forward_only(model_chunks, microbatches, temperature=temperature,
                                   vocab_size=vocab_size, groups=groups, length=length))


def compute_packed_token_logprobs(
    model_chunks: Sequence[torch.nn.Module],
    rows: Sequence[Any],
    *,
    temperature: float,
    vocab_size: int,
    groups: ParallelGroups,
) -> list[torch.Tensor]:
    """float32 ``[1, T]`` log-probs of each packed row's labels, on every rank (its device).

    ``rows``: this rank's packed microbatches, each with ``tokens``, ``labels``,
    ``position_ids`` (``[1, T]``) and ``layout`` (a ``megatron_logra.packing.RowLayout``);
    under pipeline parallelism every row has the same T (Megatron's schedule passes one
    activation shape). Under context parallelism each CP rank runs its two chunks of every
    sequence of a row and the rows are gathered back into row order. Otherwise as
    :func:`compute_token_logprobs`.
    """
    _check_temperature(temperature)
    if not rows:
        raise ValueError("rows is empty; give this rank at least one packed row")
    lengths = {row.tokens.shape[1] for row in rows}
    if groups.pp_size > 1 and len(lengths) > 1:
        raise ValueError(f"under pipeline parallelism every packed row needs the same length, "
                         f"got {sorted(lengths)}")
    config = unwrap_model(model_chunks[0]).config
    if config.sequence_parallel and any(length % groups.tp_size for length in lengths):
        raise ValueError(f"packed rows of {sorted(lengths)} tokens must be multiples of the TP "
                         f"size {groups.tp_size} under sequence parallelism")
    device = groups.device
    microbatches = [
        split_batch(_Microbatch(tokens=row.tokens.to(device), labels=row.labels.to(device),
                                position_ids=row.position_ids.to(device),
                                packed_seq_params=packed_seq_params(row.layout, device),
                                layout=row.layout), groups.cp_rank, groups.cp_size)
        for row in rows
    ]
    return _forward_only(model_chunks, microbatches, temperature=temperature,
                         vocab_size=vocab_size, groups=groups, length=max(lengths))


def _forward_only(
    model_chunks: Sequence[torch.nn.Module], microbatches: list[_Microbatch], *,
    temperature: float, vocab_size: int, groups: ParallelGroups, length: int,
) -> list[torch.Tensor]:
    """The ``[b, L]`` log-probs of each of ``microbatches`` on every rank (under pipeline
    parallelism all of one shape ``[b, length]``: the last stage broadcasts them)."""
    device = groups.device
    micro_batch_size = microbatches[0].tokens.shape[0]
    num_microbatches = len(microbatches)
    modes = [module.training for chunk in model_chunks for module in chunk.modules()]
    for chunk in model_chunks:
        chunk.eval()
    try:
        with torch.no_grad():
            collected = forward_backward(
                model_chunks, microbatches,
                functools.partial(_forward_step, temperature=temperature, vocab_size=vocab_size,
                                  tp_rank=groups.tp_rank),
                seq_length=length, micro_batch_size=micro_batch_size, forward_only=True,
                collect_non_loss_data=True,
            )
    finally:
        modules = [module for chunk in model_chunks for module in chunk.modules()]
        for module, mode in zip(modules, modes, strict=True):
            module.training = mode
    last_stage = groups.pp_rank == groups.pp_size - 1
    if last_stage and len(collected) != num_microbatches:
        raise RuntimeError(
            f"the schedule returned {len(collected)} results for {num_microbatches} microbatches"
        )

    def gathered(values: torch.Tensor, batch: _Microbatch) -> torch.Tensor:
        # This CP rank's positions -> the whole sequences (or packed row), in order.
        values = values.float().contiguous()
        if batch.layout is not None:
            return gather_packed_row(values, batch.layout, groups.cp)
        return gather_sequence(values, groups.cp, groups.cp_size)

    if groups.pp_size == 1:
        return [gathered(values, batch)
                for values, batch in zip(collected, microbatches, strict=True)]
    size = sum(batch.tokens.shape[0] for batch in microbatches)
    if last_stage:
        result = torch.cat([gathered(values, batch)
                            for values, batch in zip(collected, microbatches, strict=True)])
    else:
        result = torch.empty(size, length, dtype=torch.float32, device=device)
    last = dist.get_process_group_ranks(groups.pp)[-1]
    dist.broadcast(result, src=last, group=groups.pp)
    return list(result.split([batch.tokens.shape[0] for batch in microbatches]))
