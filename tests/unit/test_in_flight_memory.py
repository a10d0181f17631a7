"""The estimate of what rollouts generated ahead hold (megatron_logra/memory/in_flight.py)
against measurement: a batch of engine responses as each engine client keeps it, measured by
tracemalloc. (The sync-record part is checked against the bytes a real run ships, in
tests/distributed/test_async_rollouts.py.)"""

from __future__ import annotations

import gc
import pickle
import random
import tracemalloc

import pytest

from megatron_logra.memory.in_flight import PY_BYTES_PER_RESPONSE, PY_BYTES_PER_TOKEN

# The project's bound for an estimate against its measurement.
ESTIMATE_TOLERANCE = 0.10
SEQUENCES, TOKENS = 256, 64
# Token ids of a real vocabulary (beyond Python's cached small ints), log-probs of a sampler.
VOCAB = 151_000


def _reply() -> bytes:
    rng = random.Random(0)
    responses = [([rng.randrange(300, VOCAB) for _ in range(TOKENS)],
                  [-3.0 * rng.random() for _ in range(TOKENS)]) for _ in range(SEQUENCES)]
    return pickle.dumps(("ok", responses))


def _megatron_client(reply: bytes):
    _, result = pickle.loads(reply)
    return [(list(tokens), list(logprobs)) for tokens, logprobs in result]


def _vllm_client(reply: bytes):
    _, result = pickle.loads(reply)
    return [tuple(r) for r in result]


@pytest.mark.parametrize("client", [_megatron_client, _vllm_client], ids=["megatron", "vllm"])
def test_a_batch_in_flight_holds_what_the_estimate_says_within_10_percent(client):
    reply = _reply()
    gc.collect()
    tracemalloc.start()
    try:
        kept = client(reply)
        gc.collect()
        measured, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(kept) == SEQUENCES
    estimate = SEQUENCES * (TOKENS * PY_BYTES_PER_TOKEN + PY_BYTES_PER_RESPONSE)
    assert abs(measured / estimate - 1.0) <= ESTIMATE_TOLERANCE, (measured, estimate)
