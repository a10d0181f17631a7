"""The built-in rollout engine: batched sampling on this rank's Megatron GPT with a KV cache.

:class:`MegatronSampler` implements ``megatron_logra.rl.rollout.RolloutEngine`` (whose docstring
defines the sampling rule, the two log-probs and the counter-based randomness) on the same model
chunks the trainer trains. Weights are never modified; generation runs under ``torch.no_grad``
with every module in eval mode, and the modes are restored afterwards.

**KV cache.** Megatron-Core's own ``StaticInferenceContext``: ``GPTModel.forward`` takes it as
``inference_context``, every attention layer appends its keys and values to per-layer buffers
and attends over the cached prefix, and the output layer computes the logits of the last
position only. It works on CPU under the compatibility layer unchanged (the buffers are
allocated on ``torch.cuda.current_device()``, which the layer maps to the CPU) with either CPU
core attention (``model.attention=sdpa`` or ``local``: both take the cached keys and Megatron's
boolean masks). (The dynamic context needs flash-attention kernels and cannot.)
One forward prefills the whole prompt block, then each step decodes one token per sequence.

**Prompts of different lengths** are left-padded to a common block, so every sequence's next
token lands in the same cache slot and a decode step is one batched forward. Attention masks
(boolean, True = masked, Megatron's convention) hide the padding keys: causal-and-not-padding in
the prefill, not-padding in decode steps. Position ids count from each sequence's first real
token (``slot - padding``), which makes learned absolute positions exact. Megatron's rotary
embedding ignores position ids and rotates by cache slot; attention scores depend on position
*differences* only, so a per-sequence shift changes them only by float rounding (measured in
the tests against a cache-free, unpadded reference).

**Tensor parallelism.** In inference mode Megatron's ``GPTModel`` gathers the vocabulary shards
of the (last-position) logits, ``B x V`` floats per step: cheap at these sizes and it gives
every TP rank bit-identical logits, hence identical tokens from the deterministic sampling rule.

**Sequence parallelism.** The prefill runs sequence-parallel as in training (the prompt block is
padded to a multiple of the TP size). A decode step has one position per sequence, which cannot
be split over TP ranks, so sequence parallelism is switched off for decode steps (the model
config and every module's ``sequence_parallel`` / ``reduce_scatter_embeddings`` flag, the flags
Megatron's own inference engine toggles; it runs dense layers without SP altogether) and
restored afterwards. Under SP the static context takes
the last row of each rank's sequence shard and the SP output layer gathers those rows in rank
order, so the final row is the block's last position; the shape is checked every time.

**Pipeline parallelism.** Each forward passes activations stage to stage with point-to-point
send/recv over the pipeline group (a stage's KV cache holds its own layers); the last stage
samples and broadcasts the tokens and log-probs over the pipeline group, so every stage feeds
the same tokens to the next step. Virtual pipeline stages (``parallel.vpp``) are not supported
for generation.

**Data parallelism.** Each data-parallel rank generates its contiguous share of the global
prompts (``data_parallel_share``); no collective crosses data-parallel ranks except the check
that every rank was given the same request.

**Context parallelism.** The CP ranks of a replica hold the same weights, so they generate as
extra data-parallel generators: the prompts are shared over DP x CP ranks, and each rank decodes
whole sequences with the model's context parallelism switched off for the duration
(:func:`~megatron_logra.mcore.models.context_parallel.context_parallel_off`). The trainer then
gathers a replica's sequences over its CP group (``train/rl/rollouts.py``). A sequence's KV cache
is then on one rank: for responses too long for that, use a separate engine
(``rollout.placement=separate``).

Shape suffixes: B = sequences, S = positions (prompt block or 1), V = padded vocabulary.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from megatron.core.inference.contexts.static_context import StaticInferenceContext
from megatron.core.models.gpt import GPTModel

from megatron_logra.mcore.models.context_parallel import context_parallel_off
from megatron_logra.mcore.models.sharding import unwrap_model
from megatron_logra.mcore.process_groups import ParallelGroups
from megatron_logra.rl.rollout import (
    NextTokens,
    RolloutBatch,
    SamplingParams,
    data_parallel_share,
    sample_next_tokens,
    sampling_uniforms,
    validate_prompts,
)

# Module flags Megatron's layers read at run time to decide on sequence-parallel communication.
_SEQUENCE_PARALLEL_FLAGS = ("sequence_parallel", "reduce_scatter_embeddings")


@contextlib.contextmanager
def _sequence_parallel_off(model: GPTModel) -> Iterator[None]:
    """Run the model without sequence parallelism; every flag is restored on exit."""
    saved: list[tuple[object, str, bool]] = [
        (model.config, "sequence_parallel", model.config.sequence_parallel)
    ]
    for module in model.modules():
        for flag in _SEQUENCE_PARALLEL_FLAGS:
            value = getattr(module, flag, None)
            if isinstance(value, bool):
                saved.append((module, flag, value))
    try:
        for owner, flag, _ in saved:
            setattr(owner, flag, False)
        yield
    finally:
        for owner, flag, value in saved:
            setattr(owner, flag, value)


@contextlib.contextmanager
def _inference_mode(chunk: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no autograd for the duration; each module's training flag restored."""
    modules = list(chunk.modules())
    modes = [module.training for module in modules]
    chunk.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, mode in zip(modules, modes, strict=True):
            module.training = mode


def _request_digest(prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> int:
    canonical = repr((tuple(tuple(int(t) for t in p) for p in prompts), params, int(seed)))
    digest = hashlib.blake2b(canonical.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # fits int64 with room for negation


def _empty_batch(params: SamplingParams) -> RolloutBatch:
    return RolloutBatch(
        sequence_indices=(),
        prompt_tokens=(),
        response_tokens=torch.zeros(0, 0, dtype=torch.int64),
        response_lengths=torch.zeros(0, dtype=torch.int64),
        logprobs=torch.zeros(0, 0, dtype=torch.float32),
        sampling_logprobs=torch.zeros(0, 0, dtype=torch.float32),
        finished=torch.zeros(0, dtype=torch.bool),
        logprob_temperature=params.logprob_temperature,
    )


class MegatronSampler:
    """A :class:`~megatron_logra.rl.rollout.RolloutEngine` on this rank's Megatron GPT chunk.

    Args:
        model_chunks: this rank's model chunks as built by ``build_model_chunks`` (possibly
            wrapped in DDP / Float16Module); exactly one (no virtual pipeline stages).
        groups: this rank's process groups.
        vocab_size: the real (tokenizer) vocabulary; padded ids beyond it are never sampled.
        max_batch_size: generate at most this many sequences per forward (bounds the KV cache);
            None generates this rank's whole share at once. Results do not depend on it beyond
            float rounding (the padding of a chunk depends on its longest prompt).
    """

    def __init__(
        self,
        model_chunks: Sequence[torch.nn.Module],
        groups: ParallelGroups,
        *,
        vocab_size: int,
        max_batch_size: int | None = None,
    ) -> None:
        if len(model_chunks) != 1:
            raise ValueError(
                f"generation needs exactly one model chunk per rank, got {len(model_chunks)}; "
                "build the rollout model without virtual pipeline stages (parallel.vpp unset)"
            )
        model = unwrap_model(model_chunks[0])
        if not isinstance(model, GPTModel):
            raise ValueError(f"model chunk is a {type(model).__name__}, not a Megatron GPTModel")
        if not 0 < vocab_size <= model.vocab_size:
            raise ValueError(
                f"vocab_size={vocab_size} must be in [1, {model.vocab_size}] (the model's padded "
                "vocabulary); pass the tokenizer's vocabulary size"
            )
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1 or None")
        self._chunk = model_chunks[0]
        self._model = model
        self._groups = groups
        self.vocab_size = vocab_size
        self.max_batch_size = max_batch_size
        config = model.config
        self._pipeline_dtype = config.pipeline_dtype or config.params_dtype
        pp_ranks = dist.get_process_group_ranks(groups.pp)
        self._prev_rank = pp_ranks[groups.pp_rank - 1] if groups.pp_rank > 0 else None
        self._next_rank = (
            pp_ranks[groups.pp_rank + 1] if groups.pp_rank < groups.pp_size - 1 else None
        )
        self._last_rank = pp_ranks[-1]

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, seed: int
    ) -> RolloutBatch:
        """Sample one response per global prompt; returns this data-parallel rank's share.

        Collective over all ranks, which must pass the same prompts, params and seed
        (RuntimeError otherwise).
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} must be an integer >= 0")
        validate_prompts(prompts, self.vocab_size)
        if params.eos_id is not None and params.eos_id >= self.vocab_size:
            raise ValueError(
                f"eos_id={params.eos_id} is outside the vocabulary [0, {self.vocab_size}); use the "
                "tokenizer's EOS id"
            )
        model = self._model
        if model.position_embedding_type == "learned_absolute":
            longest = max((len(p) for p in prompts), default=0)
            if longest + params.max_new_tokens > model.max_sequence_length:
                raise ValueError(
                    f"the longest prompt ({longest} tokens) + max_new_tokens "
                    f"({params.max_new_tokens}) exceeds the model's learned positions "
                    f"(model.seq_length={model.max_sequence_length}); shorten the prompts, lower "
                    "max_new_tokens or raise model.seq_length"
                )
        self._check_same_request(prompts, params, seed)
        groups = self._groups
        share = data_parallel_share(len(prompts), groups.dp_rank, groups.dp_size)
        if not len(share):
            return _empty_batch(params)
        step = self.max_batch_size or len(share)
        pieces = []
        # A context-parallel model's CP ranks generate as extra data-parallel generators (the
        # share above is over DP x CP): each decodes whole sequences with its own KV cache.
        with _inference_mode(self._chunk), context_parallel_off(model):
            try:
                for start in range(0, len(share), step):
                    indices = list(share[start : start + step])
                    pieces.append(
                        self._generate_chunk([prompts[i] for i in indices], indices, params, seed)
                    )
            finally:
                if not groups.is_first_stage():
                    model.set_input_tensor(None)
        return pieces[0] if len(pieces) == 1 else RolloutBatch.merged(pieces)

    def _check_same_request(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int
    ) -> None:
        digest = _request_digest(prompts, params, seed)
        bounds = torch.tensor([digest, -digest], dtype=torch.int64, device=self._groups.device)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
        if int(bounds[0]) != -int(bounds[1]):
            raise RuntimeError(
                "MegatronSampler.generate was called with different prompts, sampling params or "
                "seeds on different ranks; every rank must pass the same global request"
            )

    def _generate_chunk(
        self, prompts: list[list[int]], indices: list[int], params: SamplingParams, seed: int
    ) -> RolloutBatch:
        groups = self._groups
        size = len(prompts)
        sequence_parallel = bool(self._model.config.sequence_parallel) and groups.tp_size > 1
        longest = max(len(p) for p in prompts)
        multiple = groups.tp_size if sequence_parallel else 1
        block = -(-longest // multiple) * multiple
        pads_B = torch.tensor([block - len(p) for p in prompts], dtype=torch.int64)
        tokens_BS = torch.zeros(size, block, dtype=torch.int64)
        for i, prompt in enumerate(prompts):
            tokens_BS[i, int(pads_B[i]) :] = torch.tensor(prompt, dtype=torch.int64)
        slots_S = torch.arange(block)
        padding_key_BS = slots_S[None, :] < pads_B[:, None]
        positions_BS = (slots_S[None, :] - pads_B[:, None]).clamp(min=0)
        causal_SS = torch.ones(block, block, dtype=torch.bool).triu(diagonal=1)
        prefill_mask = (causal_SS[None] | padding_key_BS[:, None, :])[:, None]  # [B, 1, S, S]
        context = StaticInferenceContext(size, block + params.max_new_tokens)

        limit = params.max_new_tokens
        responses = torch.zeros(size, limit, dtype=torch.int64)
        logprobs = torch.zeros(size, limit, dtype=torch.float32)
        sampling_logprobs = torch.zeros(size, limit, dtype=torch.float32)
        lengths = torch.zeros(size, dtype=torch.int64)
        finished = torch.zeros(size, dtype=torch.bool)

        logits = self._stage_forward(
            tokens_BS, positions_BS, prefill_mask, context, block, sequence_parallel
        )
        decode = _sequence_parallel_off(self._model) if sequence_parallel else contextlib.nullcontext()
        with decode:
            for step in range(limit):
                chosen = self._next_tokens(logits, indices, step, params, seed)
                # Every unfinished sequence has produced exactly `step` tokens so far.
                active = ~finished
                responses[active, step] = chosen.tokens[active]
                logprobs[active, step] = chosen.logprobs[active]
                sampling_logprobs[active, step] = chosen.sampling_logprobs[active]
                lengths += active.long()
                if params.eos_id is not None:
                    finished |= active & (chosen.tokens == params.eos_id)
                if bool(finished.all()) or step == limit - 1:
                    break
                # Finished sequences keep being fed (their outputs are ignored) so the batch
                # keeps its shape and cache slots.
                context.enable_decode_mode()
                decode_mask = torch.cat(
                    [padding_key_BS, torch.zeros(size, step + 1, dtype=torch.bool)], dim=1
                )[:, None, None, :]  # [B, 1, 1, block + step + 1]
                logits = self._stage_forward(
                    chosen.tokens[:, None], (block + step - pads_B)[:, None], decode_mask,
                    context, 1, False,
                )
        width = int(lengths.max())
        return RolloutBatch(
            sequence_indices=tuple(indices),
            prompt_tokens=tuple(tuple(p) for p in prompts),
            response_tokens=responses[:, :width].contiguous(),
            response_lengths=lengths,
            logprobs=logprobs[:, :width].contiguous(),
            sampling_logprobs=sampling_logprobs[:, :width].contiguous(),
            finished=finished,
            logprob_temperature=params.logprob_temperature,
        )

    def _stage_forward(
        self,
        tokens_BS: torch.Tensor,
        positions_BS: torch.Tensor,
        mask: torch.Tensor,
        context: StaticInferenceContext,
        length: int,
        sequence_parallel: bool,
    ) -> torch.Tensor | None:
        """This stage's part of one forward over ``length`` new positions; the last stage
        returns the ``[B, V]`` logits of the last position, other stages None."""
        groups = self._groups
        device = groups.device
        size = tokens_BS.shape[0]
        if not groups.is_first_stage():
            local = length // groups.tp_size if sequence_parallel else length
            received = torch.empty(
                local, size, self._model.config.hidden_size, dtype=self._pipeline_dtype,
                device=device,
            )
            dist.recv(received, src=self._prev_rank, group=groups.pp)
            self._model.set_input_tensor(received)
        output = self._chunk(
            tokens_BS.to(device), positions_BS.to(device), mask.to(device),
            inference_context=context, runtime_gather_output=True,
        )
        context.increment_sequence_len_offset(length)
        if not groups.is_last_stage():
            dist.send(output.to(self._pipeline_dtype).contiguous(), dst=self._next_rank,
                      group=groups.pp)
            return None
        rows = groups.tp_size if sequence_parallel else 1
        expected = (size, rows, self._model.vocab_size)
        if tuple(output.shape) != expected:
            raise RuntimeError(
                f"the model returned logits of shape {tuple(output.shape)} for a cached forward; "
                f"expected {expected} (last position only, vocabulary gathered)"
            )
        return output[:, -1, :]

    def _next_tokens(
        self,
        logits_BV: torch.Tensor | None,
        indices: list[int],
        step: int,
        params: SamplingParams,
        seed: int,
    ) -> NextTokens:
        """Sample on the last stage and share the choice with every pipeline stage."""
        groups = self._groups
        size = len(indices)
        if logits_BV is not None:
            chosen = sample_next_tokens(
                logits_BV, sampling_uniforms(seed, indices, step), params, self.vocab_size
            )
            # float32 log-probs and token ids below 2**53 are exact in float64.
            packed = torch.stack(
                [chosen.tokens.double(), chosen.logprobs.double(), chosen.sampling_logprobs.double()]
            )
        else:
            packed = torch.empty(3, size, dtype=torch.float64, device=groups.device)
        if groups.pp_size > 1:
            dist.broadcast(packed, src=self._last_rank, group=groups.pp)
        packed = packed.cpu()
        return NextTokens(packed[0].long(), packed[1].float(), packed[2].float())
