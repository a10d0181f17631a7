"""The rollout contract: what the RL trainer asks of a generation engine and what it gets back.

An engine (the built-in Megatron sampler; later a vLLM adapter) implements :class:`RolloutEngine`:
``generate(prompts, params, seed=...)`` samples one response per prompt and returns a
:class:`RolloutBatch`. This module fixes what every field means, so that engines are
interchangeable and the trainer can recompute exactly the quantities the losses compare.

**Log-probabilities.** Two float32 log-probs of each sampled token ``y_t`` are returned:

* ``logprobs``: ``log softmax(z / T)[y_t]`` over the real vocabulary, with ``T`` the sampling
  temperature and *no* top-p truncation. This is ``pi_rollout(y_t)`` of the importance weight
  ``min(pi_train / pi_rollout, cap)`` and of the rollout-vs-trainer mismatch the KL controller
  subtracts from its budget. The trainer recomputes the same quantity
  (``megatron_logra.mcore.inference.token_logprobs`` at ``batch.logprob_temperature``), so on-policy the
  two differ only by numerics, which is what the weight is meant to correct. Truncation is
  left out on purpose: the nucleus is a discontinuous function of all logits that the trainer
  can neither recompute stably nor differentiate, and a truncated ``pi_rollout`` against an
  untruncated ``pi_train`` would bias every weight by the nucleus mass even with identical
  numerics. Temperature is kept in: the policy that produced the data, and whose movement the
  KL controller measures (``p = softmax(z / T_sample)``), is the temperature-T one; a T=1
  log-prob next to a T-sampled token would make the ratio wrong by design.
* ``sampling_logprobs``: the log-prob under the distribution actually sampled from: temperature
  scaled, truncated to the top-p nucleus and renormalised, i.e. ``logprobs - log(nucleus
  mass)``. Equal to ``logprobs`` when ``top_p = 1``; 0 for greedy decoding (a certain choice).
  For exact off-policy accounting and diagnostics (``exp(logprobs - sampling_logprobs)`` is the
  nucleus mass).

Greedy decoding (``temperature = 0``) reports ``logprobs`` at temperature 1
(``logprob_temperature = 1``): there is no temperature-0 distribution to score against.

**Randomness** is counter based: the uniform number that picks the token of global sequence ``i``
at generation step ``k`` is a keyed hash of ``(seed, i, k)`` (:func:`sampling_uniforms`). A sample
therefore depends only on the seed, its index in the global batch, its own prefix and the logits:
not on the parallel layout, on which data-parallel rank generates it, on how the batch is split
into chunks, or on the other sequences. Every tensor-parallel rank holds the same gathered logits
and so draws the same tokens. Across layouts the logits agree only to float rounding, so a draw
can differ only when its uniform lands within that rounding of a CDF boundary (probability
~1e-6 per token in fp32).

**Sampling rule** (:func:`sample_next_tokens`, the reference every engine follows): take the
logits of the real vocabulary (ids at and beyond ``vocab_size`` are padding and never sampled),
``p = softmax(z / T)`` in float64, the nucleus = the smallest set of most probable tokens whose
mass reaches ``top_p`` (ties broken towards lower ids), then invert the CDF of the nucleus in
*vocabulary-id order* at ``u * nucleus_mass``. Vocabulary order, not probability order: a sorted
order would let two near-equal probabilities swap places under rounding and flip the draw with
probability ~p, while in id order rounding only moves boundaries by rounding.

Data parallelism: callers pass the *global* prompt list (identical on every rank); each rank
generates the contiguous share :func:`data_parallel_share` of its data-parallel rank and the
returned batch names them by ``sequence_indices``. An engine serving the whole batch from one
process returns all of them.

Shape suffixes: B = sequences, R = response positions, L = padded prompt+response positions,
V = vocabulary.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

_UNIFORM_BITS = 53  # a float64 mantissa: every value k / 2**53 is exact


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample responses.

    Attributes:
        max_new_tokens: at most this many tokens per response (the stop token included).
        temperature: softmax temperature; 0 means greedy decoding (argmax, lowest id on ties).
        top_p: nucleus size in (0, 1]; 1 samples from the whole distribution.
        stop_ids: a response ends with (and keeps) the first of these tokens it samples (EOS,
            the chat template's end of turn, generation_config's eos_token_id list; see
            ``megatron_logra.data.prompt_builder``); generation stops once every response has
            ended. Empty: every response runs to ``max_new_tokens``.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or (
            self.max_new_tokens < 1
        ):
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens!r} must be a positive integer (the response "
                "length limit)"
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(
                f"temperature={self.temperature!r} must be a finite number >= 0 (0 for greedy "
                "decoding, 1 to sample the model's distribution)"
            )
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]; use 1 to disable nucleus "
                             "sampling")
        if not isinstance(self.stop_ids, tuple) or any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_ids
        ):
            raise ValueError(f"stop_ids={self.stop_ids!r} must be a tuple of token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature of ``RolloutBatch.logprobs`` (1 for greedy decoding)."""
        return 1.0 if self.greedy else float(self.temperature)


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    """ValueError unless ``prompts`` is a list of non-empty token-id lists inside the vocabulary."""
    if not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, Sequence) or isinstance(prompt, (str, bytes)) or not prompt:
            raise ValueError(
                f"prompts[{i}]={prompt!r} must be a non-empty list of token ids (tokenize the text "
                "first)"
            )
        for j, token in enumerate(prompt):
            if isinstance(token, bool) or not isinstance(token, int) or not (
                0 <= token < vocab_size
            ):
                raise ValueError(
                    f"prompts[{i}][{j}]={token!r} is not a token id in [0, {vocab_size}); use ids "
                    "of the model's tokenizer"
                )


def data_parallel_share(num_sequences: int, dp_rank: int, dp_size: int) -> range:
    """Global indices that data-parallel rank ``dp_rank`` generates: a contiguous block, the
    blocks of all ranks covering ``range(num_sequences)`` with sizes differing by at most one."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    if num_sequences < 0:
        raise ValueError(f"num_sequences={num_sequences} must be >= 0")
    return range(num_sequences * dp_rank // dp_size, num_sequences * (dp_rank + 1) // dp_size)


def sampling_uniforms(seed: int, sequence_indices: Sequence[int], step: int) -> torch.Tensor:
    """Float64 ``[B]`` uniforms in [0, 1), one per global sequence index, for generation step
    ``step``: a BLAKE2b hash of ``(seed, index, step)``, identical in every process and layout."""
    if seed < 0 or step < 0:
        raise ValueError(f"seed={seed} and step={step} must be >= 0")
    values = []
    for index in sequence_indices:
        material = f"megatron_logra.rollout.v1|{seed}|{int(index)}|{step}".encode()
        word = int.from_bytes(hashlib.blake2b(material, digest_size=8).digest(), "little")
        values.append((word >> (64 - _UNIFORM_BITS)) / float(1 << _UNIFORM_BITS))
    return torch.tensor(values, dtype=torch.float64)


class NextTokens(NamedTuple):
    """One generation step's choice for every sequence (all ``[B]``)."""

    tokens: torch.Tensor
    """int64 sampled token ids."""
    logprobs: torch.Tensor
    """float32 ``log softmax(z / T)[token]`` (T = 1 for greedy), untruncated."""
    sampling_logprobs: torch.Tensor
    """float32 log-prob under the nucleus-renormalised distribution (0 for greedy)."""


def sample_next_tokens(
    logits_BV: torch.Tensor, uniforms_B: torch.Tensor, params: SamplingParams, vocab_size: int
) -> NextTokens:
    """The sampling rule of the module docstring, on full-vocabulary logits.

    Args:
        logits_BV: ``[B, V]`` logits, ``V >= vocab_size``; columns from ``vocab_size`` on are
            vocabulary padding and are ignored.
        uniforms_B: ``[B]`` uniforms in [0, 1) (:func:`sampling_uniforms`); unused when greedy.
        params: temperature and top_p.
        vocab_size: the real (tokenizer) vocabulary size.
    """
    if logits_BV.dim() != 2 or not 0 < vocab_size <= logits_BV.shape[1]:
        raise ValueError(
            f"logits {tuple(logits_BV.shape)} must be [B, V] with V >= vocab_size={vocab_size} > 0"
        )
    if uniforms_B.shape != logits_BV.shape[:1]:
        raise ValueError(f"uniforms {tuple(uniforms_B.shape)} must be [B] = [{logits_BV.shape[0]}]")
    z_BV = logits_BV[:, :vocab_size].float()
    if params.greedy:
        tokens_B = z_BV.argmax(dim=-1)  # the first maximum: lowest id on ties
        logprobs_B = torch.log_softmax(z_BV, dim=-1).gather(1, tokens_B[:, None]).squeeze(1)
        return NextTokens(tokens_B, logprobs_B, torch.zeros_like(logprobs_B))

    scaled_BV = z_BV / params.temperature
    p_BV = torch.softmax(scaled_BV.double(), dim=-1)
    if params.top_p < 1.0:
        p_sorted, order = torch.sort(p_BV, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(p_sorted, dim=-1) - p_sorted
        keep_sorted = mass_before < params.top_p  # always keeps the most probable token
        keep_BV = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
        p_BV = torch.where(keep_BV, p_BV, 0.0)
    cdf_BV = torch.cumsum(p_BV, dim=-1)
    mass_B = cdf_BV[:, -1]
    targets_B = uniforms_B.to(device=mass_B.device, dtype=torch.float64) * mass_B
    # The first id whose CDF exceeds the target has a positive increment, so it is in the
    # nucleus; the clamp only guards u * mass rounding onto the last boundary.
    tokens_B = torch.searchsorted(cdf_BV, targets_B[:, None], right=True).squeeze(1)
    last_kept_B = vocab_size - 1 - (p_BV.flip(-1) > 0).int().argmax(dim=-1)
    tokens_B = torch.minimum(tokens_B, last_kept_B)
    logprobs_B = torch.log_softmax(scaled_BV, dim=-1).gather(1, tokens_B[:, None]).squeeze(1)
    if params.top_p < 1.0:
        sampling_logprobs_B = (logprobs_B.double() - torch.log(mass_B)).float()
    else:
        sampling_logprobs_B = logprobs_B.clone()
    return NextTokens(tokens_B, logprobs_B, sampling_logprobs_B)


@dataclass(frozen=True)
class PaddedRollout:
    """A rollout batch laid out for the trainer's forward pass (Megatron's LM convention).

    Row ``i`` is ``prompt_i + response_i`` followed by ``pad_id``; ``labels`` are the next tokens,
    so the per-token log-probs the trainer computes for ``labels`` line up with ``response_mask``
    and the rollout log-probs. Positions are ``0..L-1`` in every row.
    """

    tokens: torch.Tensor
    """int64 ``[B, L]``."""
    labels: torch.Tensor
    """int64 ``[B, L]``: ``labels[:, t] = tokens[:, t + 1]``, ``pad_id`` in the last column."""
    position_ids: torch.Tensor
    """int64 ``[B, L]``."""
    response_mask: torch.Tensor
    """bool ``[B, L]``: True where ``labels[:, t]`` is a response token."""
    rollout_logprobs: torch.Tensor
    """float32 ``[B, L]``: ``RolloutBatch.logprobs`` at the response-mask positions, 0 elsewhere."""
    sampling_logprobs: torch.Tensor
    """float32 ``[B, L]``: ``RolloutBatch.sampling_logprobs`` likewise."""
    prompt_lengths: torch.Tensor
    """int64 ``[B]``."""
    response_lengths: torch.Tensor
    """int64 ``[B]``."""
    finished: torch.Tensor
    """bool ``[B]``: the response ended with a stop token."""
    logprob_temperature: float
    """Recompute the trainer's log-probs at this temperature."""


@dataclass(frozen=True)
class RolloutBatch:
    """The responses one rank generated (see the module docstring for every quantity).

    Tensors live on the CPU. Response tensors are right-padded to the longest response: positions
    at and beyond ``response_lengths[i]`` hold 0 in every tensor and mean nothing.
    """

    sequence_indices: tuple[int, ...]
    """Global index of each sequence in the ``generate`` call, ascending."""
    prompt_tokens: tuple[tuple[int, ...], ...]
    response_tokens: torch.Tensor
    """int64 ``[B, R]``; a finished response ends with its stop token."""
    response_lengths: torch.Tensor
    """int64 ``[B]``, in ``[1, R]``."""
    logprobs: torch.Tensor
    """float32 ``[B, R]``: temperature-scaled, untruncated (the importance weight's pi_rollout)."""
    sampling_logprobs: torch.Tensor
    """float32 ``[B, R]``: under the distribution actually sampled (top-p renormalised)."""
    finished: torch.Tensor
    """bool ``[B]``: True when the response ended with a stop token (False: cut at
    max_new_tokens)."""
    logprob_temperature: float

    def __post_init__(self) -> None:
        size = len(self.sequence_indices)
        if len(self.prompt_tokens) != size:
            raise ValueError(
                f"RolloutBatch has {size} sequence_indices but {len(self.prompt_tokens)} prompts"
            )
        if any(not prompt for prompt in self.prompt_tokens):
            raise ValueError("every prompt of a RolloutBatch must hold at least one token")
        if list(self.sequence_indices) != sorted(set(self.sequence_indices)):
            raise ValueError("RolloutBatch.sequence_indices must be distinct and ascending")
        tokens = self.response_tokens
        if tokens.dim() != 2 or tokens.shape[0] != size or tokens.dtype != torch.int64:
            raise ValueError(
                f"response_tokens must be int64 [{size}, R], got {tokens.dtype} "
                f"{tuple(tokens.shape)}"
            )
        for name in ("logprobs", "sampling_logprobs"):
            value = getattr(self, name)
            if value.shape != tokens.shape or value.dtype != torch.float32:
                raise ValueError(
                    f"{name} must be float32 {tuple(tokens.shape)} like response_tokens, got "
                    f"{value.dtype} {tuple(value.shape)}"
                )
        lengths = self.response_lengths
        if lengths.shape != (size,) or lengths.dtype != torch.int64:
            raise ValueError(f"response_lengths must be int64 [{size}], got {tuple(lengths.shape)}")
        if size and (lengths.min() < 1 or lengths.max() > tokens.shape[1]):
            raise ValueError(f"response_lengths must be in [1, {tokens.shape[1]}]")
        if self.finished.shape != (size,) or self.finished.dtype != torch.bool:
            raise ValueError(f"finished must be bool [{size}]")
        if not (math.isfinite(self.logprob_temperature) and self.logprob_temperature > 0):
            raise ValueError(f"logprob_temperature={self.logprob_temperature!r} must be > 0")
        padding = ~self.response_mask()
        if (tokens[padding] != 0).any() or (self.logprobs[padding] != 0).any() or (
            self.sampling_logprobs[padding] != 0
        ).any():
            raise ValueError("positions beyond a response's length must hold 0")

    def __len__(self) -> int:
        return len(self.sequence_indices)

    def response_mask(self) -> torch.Tensor:
        """bool ``[B, R]``: True at generated positions."""
        width = self.response_tokens.shape[1]
        positions = torch.arange(width, device=self.response_lengths.device)
        return positions[None, :] < self.response_lengths[:, None]

    def responses(self) -> list[list[int]]:
        """Each response's token ids, without padding."""
        return [
            self.response_tokens[i, : int(self.response_lengths[i])].tolist()
            for i in range(len(self))
        ]

    def to_padded(self, pad_id: int, *, pad_to_multiple_of: int = 1) -> PaddedRollout:
        """The trainer's view: prompt+response rows, right-padded with ``pad_id`` to a length
        that is a multiple of ``pad_to_multiple_of`` (the TP size under sequence parallelism)."""
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} must be >= 1")
        if pad_id < 0:
            raise ValueError(f"pad_id={pad_id} must be a token id >= 0")
        size = len(self)
        prompt_lengths = torch.tensor([len(p) for p in self.prompt_tokens], dtype=torch.int64)
        totals = prompt_lengths + self.response_lengths
        longest = int(totals.max()) if size else 1
        length = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
        tokens = torch.full((size, length), pad_id, dtype=torch.int64)
        response_mask = torch.zeros(size, length, dtype=torch.bool)
        rollout_logprobs = torch.zeros(size, length, dtype=torch.float32)
        sampling_logprobs = torch.zeros(size, length, dtype=torch.float32)
        for i, prompt in enumerate(self.prompt_tokens):
            start, count = len(prompt), int(self.response_lengths[i])
            tokens[i, :start] = torch.tensor(prompt, dtype=torch.int64)
            tokens[i, start : start + count] = self.response_tokens[i, :count]
            # Response token j sits at position start + j and is the label of position
            # start + j - 1.
            response_mask[i, start - 1 : start - 1 + count] = True
            rollout_logprobs[i, start - 1 : start - 1 + count] = self.logprobs[i, :count]
            sampling_logprobs[i, start - 1 : start - 1 + count] = self.sampling_logprobs[i, :count]
        labels = torch.full_like(tokens, pad_id)
        labels[:, :-1] = tokens[:, 1:]
        return PaddedRollout(
            tokens=tokens,
            labels=labels,
            position_ids=torch.arange(length, dtype=torch.int64)[None, :].repeat(size, 1),
            response_mask=response_mask,
            rollout_logprobs=rollout_logprobs,
            sampling_logprobs=sampling_logprobs,
            prompt_lengths=prompt_lengths,
            response_lengths=self.response_lengths.clone(),
            finished=self.finished.clone(),
            logprob_temperature=self.logprob_temperature,
        )

    @classmethod
    def merged(cls, batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """One batch holding the sequences of ``batches`` (e.g. every data-parallel rank's share),
        ordered by global index; the indices must be disjoint."""
        batches = [batch for batch in batches if len(batch)]
        if not batches:
            raise ValueError("merged() needs at least one non-empty RolloutBatch")
        temperatures = {batch.logprob_temperature for batch in batches}
        if len(temperatures) != 1:
            raise ValueError(f"cannot merge batches with logprob temperatures {sorted(temperatures)}")
        indices = [index for batch in batches for index in batch.sequence_indices]
        if len(set(indices)) != len(indices):
            raise ValueError("merged() got batches that share sequence indices")
        width = max(batch.response_tokens.shape[1] for batch in batches)

        def widen(tensor: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]))

        order = sorted(range(len(indices)), key=indices.__getitem__)
        order_t = torch.tensor(order, dtype=torch.int64)
        prompts = [prompt for batch in batches for prompt in batch.prompt_tokens]
        return cls(
            sequence_indices=tuple(indices[i] for i in order),
            prompt_tokens=tuple(prompts[i] for i in order),
            response_tokens=torch.cat([widen(b.response_tokens) for b in batches])[order_t],
            response_lengths=torch.cat([b.response_lengths for b in batches])[order_t],
            logprobs=torch.cat([widen(b.logprobs) for b in batches])[order_t],
            sampling_logprobs=torch.cat([widen(b.sampling_logprobs) for b in batches])[order_t],
            finished=torch.cat([b.finished for b in batches])[order_t],
            logprob_temperature=temperatures.pop(),
        )


class RolloutEngine(Protocol):
    """Anything that turns prompts into a :class:`RolloutBatch` under this module's contract."""

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, seed: int
    ) -> RolloutBatch:
        """Sample one response per prompt of the *global* batch ``prompts`` (the same list on
        every rank; repeat a prompt to sample it several times). Returns the sequences this rank
        is responsible for, named by their global index. Collective over all ranks of a
        distributed engine."""
        ...
