"""Rollouts from a separate engine (``rollout.placement=separate``), as the RL step's
``RolloutEngine``.

World rank 0 owns the :class:`~megatron_logra.rollout.engine.GenerationEngine`; it sends the
step's global prompt list, and every trainer rank receives the responses and keeps its
data-parallel share, so the rest of the step is the colocated one. The engine returns the
tokens and the untruncated log-probs (``pi_rollout``); the RolloutBatch fields follow from them:
``finished`` is "ends with one of the stop tokens" (the engine is given the set), and the sampled distribution's log-probs are the untruncated
ones at top_p = 1 (the config refuses top_p < 1 for a separate engine) and 0 for greedy
decoding, as ``megatron_logra.rl.rollout`` defines them.
"""

from __future__ import annotations

import torch

from megatron_logra.mcore import ParallelGroups
from megatron_logra.rl.rollout import (
    RolloutBatch,
    SamplingParams,
    data_parallel_share,
    validate_prompts,
)
from megatron_logra.rollout.engine import EngineResponse, GenerationEngine
from megatron_logra.train.rl.collectives import from_world_rank0


def rollout_batch(responses: list[EngineResponse], prompts: list[list[int]], indices: range,
                  params: SamplingParams) -> RolloutBatch:
    """The RolloutBatch of the sequences ``indices`` from an engine's global responses."""
    if params.top_p < 1.0:
        raise ValueError(f"top_p={params.top_p}: a separate engine returns no nucleus-"
                         "renormalised log-probs; sample with top_p=1")
    chosen = [responses[i] for i in indices]
    for i, (tokens, logprobs) in zip(indices, chosen, strict=True):
        if not tokens or len(tokens) != len(logprobs) or len(tokens) > params.max_new_tokens:
            raise RuntimeError(
                f"the engine's response {i} has {len(tokens)} tokens and {len(logprobs)} "
                f"log-probs; it must have 1..max_new_tokens={params.max_new_tokens} of each"
            )
    width = max((len(tokens) for tokens, _ in chosen), default=0)
    size = len(chosen)
    tokens_BR = torch.zeros(size, width, dtype=torch.int64)
    logprobs_BR = torch.zeros(size, width, dtype=torch.float32)
    for row, (tokens, logprobs) in enumerate(chosen):
        tokens_BR[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        logprobs_BR[row, : len(tokens)] = torch.tensor(logprobs, dtype=torch.float32)
    finished = torch.tensor([tokens[-1] in params.stop_ids for tokens, _ in chosen],
                            dtype=torch.bool)
    return RolloutBatch(
        sequence_indices=tuple(indices),
        prompt_tokens=tuple(tuple(prompts[i]) for i in indices),
        response_tokens=tokens_BR,
        response_lengths=torch.tensor([len(t) for t, _ in chosen], dtype=torch.int64),
        logprobs=logprobs_BR,
        sampling_logprobs=torch.zeros_like(logprobs_BR) if params.greedy else logprobs_BR.clone(),
        finished=finished,
        logprob_temperature=params.logprob_temperature,
    )


class SeparateEngineRollouts:
    """A ``RolloutEngine`` over a separate engine held by world rank 0 (None elsewhere).

    Collective over the whole trainer: every rank calls :meth:`generate` with the same request.
    """

    def __init__(self, engine: GenerationEngine | None, groups: ParallelGroups,
                 *, vocab_size: int) -> None:
        self.engine = engine
        self.groups = groups
        self.vocab_size = vocab_size

    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 seed: int) -> RolloutBatch:
        validate_prompts(prompts, self.vocab_size)

        def ask() -> list[EngineResponse]:
            assert self.engine is not None, "world rank 0 owns the rollout engine"
            responses = self.engine.generate(
                prompts, max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                top_p=params.top_p, seed=seed, stop_token_ids=list(params.stop_ids))
            if len(responses) != len(prompts):
                raise RuntimeError(f"the engine answered {len(responses)} of {len(prompts)} "
                                   "prompts")
            return responses

        responses = from_world_rank0(ask, "rollout engine generate")
        share = data_parallel_share(len(prompts), self.groups.dp_rank, self.groups.dp_size)
        return rollout_batch(responses, prompts, share, params)
