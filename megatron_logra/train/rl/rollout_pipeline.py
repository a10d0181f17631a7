"""Rollouts of a separate engine requested ahead of their step, each tagged with the policy
version that generates it (``rollout.max_staleness``; docs/async.md).

**Versions.** The trainer's policy version is the number of completed RL steps: step ``s`` starts
at version ``s``, its updates make version ``s + 1``, whose sync records the policy sync posts to
the engine at the end of the step. The engine serves its calls in order
(:mod:`megatron_logra.rollout.engine_queue`), so a generation requested after the records of
version ``v`` and before those of ``v + 1`` samples with version ``v``: the batch's version is the
trainer's version when it is requested. The weight check of the policy sync (``sync.
check_interval``) compares the engine's served weights with the trainer's after the records of a
version and before any generation with it.

**Schedule.** At the start of step ``s`` the batches of steps ``s .. s + N`` (N =
``rollout.max_staleness``, never past the run's last step) not yet requested are requested at
version ``s``; then step ``s`` takes its own, generated at version ``>= s - N``. With N = 0 that
is the synchronous loop (request, wait, train); with N = 1 the engine generates batch ``s + 1``
while the trainer updates on batch ``s``. A batch is never trained on at more than N versions
old: :meth:`RolloutPipeline.take` refuses it.

**Checkpoints.** A checkpoint holds the batches in flight (their responses, waited for at the save,
and their versions): a resumed run trains on exactly the batches the uninterrupted run would have
(no prompt lost, none repeated, the same samples), and requests the later ones as it would have.
A stored batch older than the resumed run's ``max_staleness`` allows, or sampled with another
seed or ``rl.sampling``, is dropped and generated again (the step's prompts, the resumed
policy).

Collective over the trainer: every rank makes the same calls; world rank 0 holds the engine's
queue (None elsewhere) and hands each batch to every rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_logra.mcore import ParallelGroups
from megatron_logra.rl.rollout import (
    RolloutBatch,
    SamplingParams,
    data_parallel_share,
    validate_prompts,
)
from megatron_logra.rollout.engine import EngineResponse
from megatron_logra.rollout.engine_queue import EngineQueue, Ticket
from megatron_logra.train.rl.engine_rollouts import check_response_ids, rollout_batch
from megatron_logra.train.rl.engine_waits import EngineWaits

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    """One step's batch: what was asked, at which version, and its answer once known."""

    prompts: list[list[int]]
    params: SamplingParams
    seed: int
    version: int
    ticket: Ticket | None = None  # world rank 0, while the engine has not answered
    responses: list[EngineResponse] | None = None
    generation_s: float = 0.0


@dataclass(frozen=True)
class TakenBatch:
    """A step's batch as the trainer takes it."""

    rollout: RolloutBatch
    version: int
    """The policy version that generated it."""
    staleness: int
    """The trainer's version minus ``version``."""
    wait_s: float
    """How long the trainer waited for it (world rank 0's clock)."""
    generation_s: float
    """How long the engine took to generate it (world rank 0's clock; 0 when restored)."""


class RolloutPipeline:
    """The separate engine's batches of the coming steps.

    Args:
        calls: the engine's queue (world rank 0; None on the other ranks).
        waits: how the other ranks wait on rank 0's answers (as long as the engine's timeouts
            allow).
        max_staleness: ``rollout.max_staleness``.
    """

    def __init__(self, calls: EngineQueue | None, groups: ParallelGroups, waits: EngineWaits, *,
                 vocab_size: int, max_staleness: int) -> None:
        self.calls = calls
        self.groups = groups
        self.waits = waits
        self.vocab_size = vocab_size
        self.max_staleness = max_staleness
        self._requests: dict[int, _Request] = {}

    def request(self, step: int, prompts: list[list[int]], params: SamplingParams, *,
                seed: int, version: int) -> None:
        """Ask for step ``step``'s batch now, at ``version`` (nothing if it was asked already).
        Not a collective: no rank waits here."""
        if step in self._requests:
            return
        validate_prompts(prompts, self.vocab_size)
        request = _Request(prompts=prompts, params=params, seed=seed, version=version)
        if self.calls is not None:
            request.ticket = self.calls.submit(
                "generate", prompts, max_new_tokens=params.max_new_tokens,
                temperature=params.temperature, top_p=params.top_p, seed=seed,
                stop_token_ids=list(params.stop_ids))
        self._requests[step] = request

    def take(self, step: int, prompts: list[list[int]], params: SamplingParams, *, seed: int,
             version: int) -> TakenBatch:
        """Step ``step``'s batch, trained at ``version``: this rank's share (collective)."""
        request = self._requests.get(step)
        if request is not None and (request.prompts, request.params, request.seed) != (
                prompts, params, seed):
            raise RuntimeError(f"the batch requested for step {step + 1} has other prompts, "
                               "sampling or seed than the step asks for")
        if request is None:
            self.request(step, prompts, params, seed=seed, version=version)
            request = self._requests[step]
        staleness = version - request.version
        if not 0 <= staleness <= self.max_staleness:
            raise RuntimeError(
                f"step {step + 1}'s batch was generated by policy version {request.version}; "
                f"training it at version {version} exceeds rollout.max_staleness="
                f"{self.max_staleness}")
        start = time.perf_counter()
        self._answer(request, f"rollout engine generate (step {step + 1})")
        wait_s = time.perf_counter() - start
        del self._requests[step]
        share = data_parallel_share(len(prompts), self.groups.dp_rank, self.groups.dp_size)
        return TakenBatch(rollout=rollout_batch(request.responses, prompts, share, params),
                          version=request.version, staleness=staleness, wait_s=wait_s,
                          generation_s=request.generation_s)

    def in_flight(self) -> list[int]:
        """The steps whose batches are requested and not yet taken."""
        return sorted(self._requests)

    def for_step(self, step: int, *, version: int, last_step: int,
                 batch_of: Callable[[int], tuple[list[list[int]], SamplingParams, int]],
                 ) -> StepRollouts:
        """Request the batches of steps ``step .. min(step + N, last_step)`` not requested yet,
        at ``version``; the ``RolloutEngine`` whose ``generate`` takes step ``step``'s.
        ``batch_of(s)``: step ``s``'s prompt ids, sampling and seed."""
        for ahead in range(step, min(step + self.max_staleness, last_step) + 1):
            if ahead not in self._requests:
                prompts, params, seed = batch_of(ahead)
                self.request(ahead, prompts, params, seed=seed, version=version)
        return StepRollouts(self, step, version)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The batches in flight, waited for (collective): step, version, responses."""
        batches = []
        for step in sorted(self._requests):
            request = self._requests[step]
            self._answer(request, f"rollout engine generate (step {step + 1}, for the checkpoint)")
            batches.append({"step": step, "version": request.version, "seed": request.seed,
                            "sampling": _sampling_key(request.params),
                            **_pack(request.responses)})
        return {"batches": batches}

    def load_state_dict(self, state: dict[str, Any] | None, *, prompts_of, params: SamplingParams,
                        seed_of, start_step: int) -> None:
        """Restore the batches in flight of a checkpoint taken after ``start_step`` steps.

        ``prompts_of(step)`` / ``seed_of(step)``: the prompt ids and sampling seed of a step
        (a stored batch holds responses only; its prompts are the schedule's)."""
        self._requests.clear()
        for batch in (state or {}).get("batches", []):
            step, version = int(batch["step"]), int(batch["version"])
            if step < start_step or version >= start_step:
                raise RuntimeError(f"the checkpoint of step {start_step} holds a batch for step "
                                   f"{step + 1} generated at version {version}: not a batch in "
                                   "flight at that step")
            if step - version > self.max_staleness:
                logger.warning(
                    "the checkpoint's batch for step %d (policy version %d) is older than "
                    "rollout.max_staleness=%d allows: it is generated again (same prompts and "
                    "seed, the resumed policy)", step + 1, version, self.max_staleness)
                continue
            if (int(batch["seed"]), list(batch["sampling"])) != (seed_of(step),
                                                                 _sampling_key(params)):
                logger.warning(
                    "the checkpoint's batch for step %d was sampled with another seed or "
                    "rl.sampling than the resumed run's: it is generated again", step + 1)
                continue
            self._requests[step] = _Request(prompts=prompts_of(step), params=params,
                                            seed=seed_of(step), version=version,
                                            responses=_unpack(batch))

    # ------------------------------------------------------------------ internals

    def _answer(self, request: _Request, what: str) -> None:
        """Fill ``request.responses`` on every rank (waiting on rank 0 if need be)."""
        if request.responses is not None:
            return

        def wait() -> list[EngineResponse]:
            assert self.calls is not None and request.ticket is not None, \
                "world rank 0 owns the rollout engine"
            responses = self.calls.wait(request.ticket)
            if len(responses) != len(request.prompts):
                raise RuntimeError(f"the engine answered {len(responses)} of "
                                   f"{len(request.prompts)} prompts")
            check_response_ids(responses, self.vocab_size)  # raised on every rank
            return responses

        request.responses = self.waits.run(wait, what)
        if request.ticket is not None:
            request.generation_s = request.ticket.duration_s
            request.ticket = None


class StepRollouts:
    """The ``RolloutEngine`` of one step: ``generate`` takes the step's batch from the pipeline
    (the prompts, sampling and seed must be the requested ones); ``taken`` holds it after."""

    def __init__(self, pipeline: RolloutPipeline, step: int, version: int) -> None:
        self.pipeline, self.step, self.version = pipeline, step, version
        self.taken: TakenBatch | None = None

    def generate(self, prompts: list[list[int]], params: SamplingParams, *,
                 seed: int) -> RolloutBatch:
        self.taken = self.pipeline.take(self.step, prompts, params, seed=seed,
                                        version=self.version)
        return self.taken.rollout


def async_step_metrics(taken: TakenBatch | None, calls: EngineQueue | None, *, start: float,
                       end: float, waited_before: float) -> dict[str, Any]:
    """A step's record of its batch and of the two sides' time (world rank 0's clock; the other
    ranks, which hold no queue, report their own wait and no engine time).

    ``staleness`` / ``batch_version``: the batch's; ``rollout_wait_s``: the wait for it;
    ``generation_time_s``: the engine's time generating it; ``trainer_idle_s``: the step's time
    blocked on the engine (that wait, weight reads, and at staleness 0 every call);
    ``engine_busy_s`` / ``engine_idle_s``: the step's time the engine spent in calls or not."""
    if taken is None:
        raise RuntimeError("the step trained on no batch of the pipeline")
    wall = end - start
    busy = calls.busy_s(start, end) if calls is not None else 0.0
    idle = calls.waited_s - waited_before if calls is not None else taken.wait_s
    return {"staleness": taken.staleness, "batch_version": taken.version,
            "rollout_wait_s": taken.wait_s, "generation_time_s": taken.generation_s,
            "trainer_idle_s": idle, "engine_busy_s": busy,
            "engine_idle_s": max(wall - busy, 0.0) if calls is not None else 0.0}


def _sampling_key(params: SamplingParams) -> list[float]:
    """What of the sampling a stored batch must share with the run that resumes it."""
    return [float(params.max_new_tokens), float(params.temperature), float(params.top_p)]


def _pack(responses: list[EngineResponse]) -> dict[str, torch.Tensor]:
    """Responses as three flat tensors (a checkpoint's common state holds tensors compactly)."""
    lengths = torch.tensor([len(tokens) for tokens, _ in responses], dtype=torch.int64)
    tokens = torch.tensor([t for tokens, _ in responses for t in tokens], dtype=torch.int64)
    # The engines' log-probs are float32 values (sent as Python floats): exact in float32.
    logprobs = torch.tensor([x for _, lps in responses for x in lps], dtype=torch.float32)
    return {"lengths": lengths, "tokens": tokens, "logprobs": logprobs}


def _unpack(batch: dict[str, Any]) -> list[EngineResponse]:
    lengths = batch["lengths"].tolist()
    tokens, logprobs = batch["tokens"].tolist(), batch["logprobs"].tolist()
    out, start = [], 0
    for n in lengths:
        out.append((tokens[start:start + n], logprobs[start:start + n]))
        start += n
    return out
