"""A checkpoint's batches in flight (megatron_logra/train/rl/rollout_pipeline.py): restored as
they were stored, and generated again -- never trained -- when the resumed run may not use them.
(The whole path, save with a batch in flight to an exact resume, runs on real engines in
tests/distributed/test_async_rollouts.py.)"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.rl.rollout import SamplingParams
from megatron_logra.train.rl.rollout_pipeline import RolloutPipeline, _pack, _sampling_key

PARAMS = SamplingParams(max_new_tokens=4, temperature=0.7, stop_ids=(2,))
RESPONSES = [([5, 6, 2], [-0.0625, -2.5, -0.75]), ([7, 8, 9, 10], [-1.0, -0.5, -3.25, -0.125])]
START = 2  # the checkpoint was taken after 2 steps


def _seed(step: int) -> int:
    return 1000 + step


def _stored(step: int, version: int, params: SamplingParams = PARAMS) -> dict:
    return {"step": step, "version": version, "seed": _seed(step),
            "sampling": _sampling_key(params), **_pack(RESPONSES)}


def _restore(state: dict, max_staleness: int) -> RolloutPipeline:
    pipeline = RolloutPipeline(None, None, None, vocab_size=100, max_staleness=max_staleness)
    pipeline.load_state_dict(state, prompts_of=lambda s: [[1, s]], params=PARAMS, seed_of=_seed,
                             start_step=START)
    return pipeline


def test_stored_batches_come_back_with_their_versions_and_exact_responses():
    # N = 2: at the start of step 1 (version 1) the batches of steps 2 and 3 were requested.
    pipeline = _restore({"batches": [_stored(2, 1), _stored(3, 1)]}, max_staleness=2)
    assert pipeline.in_flight() == [2, 3]
    request = pipeline._requests[3]
    assert (request.version, request.seed, request.prompts) == (1, _seed(3), [[1, 3]])
    # float32 log-probs (what the engines send) survive the flat tensors bit for bit.
    assert request.responses == RESPONSES
    assert _pack(RESPONSES)["logprobs"].dtype == torch.float32


@pytest.mark.parametrize(("max_staleness", "kept"), [(2, [2, 3]), (1, [2]), (0, [])])
def test_a_batch_staler_than_the_resumed_runs_bound_is_generated_again(max_staleness, kept):
    # Trained at version = its step: step 2's batch is 1 version old, step 3's 2.
    pipeline = _restore({"batches": [_stored(2, 1), _stored(3, 1)]}, max_staleness)
    assert pipeline.in_flight() == kept


def test_a_batch_sampled_otherwise_than_the_resumed_run_is_generated_again():
    hotter = SamplingParams(max_new_tokens=4, temperature=1.0, stop_ids=(2,))
    pipeline = _restore({"batches": [_stored(2, 1, hotter)]}, max_staleness=1)
    assert pipeline.in_flight() == []


@pytest.mark.parametrize(("step", "version"), [(1, 0), (2, 2)])
def test_a_batch_that_cannot_have_been_in_flight_at_the_checkpoint_is_refused(step, version):
    with pytest.raises(RuntimeError, match="not a batch in flight at that step"):
        _restore({"batches": [_stored(step, version)]}, max_staleness=2)
