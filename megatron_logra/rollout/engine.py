"""The protocol of a separate rollout engine: what the trainer asks of it, what it returns.

Both engines implement :class:`GenerationEngine`: the built-in Megatron sampler served from its
own processes (``rollout.engine=megatron``) and vLLM (``rollout.engine=vllm``). The trainer
(global rank 0) owns the engine object; it is not a collective over the trainer's ranks.

**generate** samples one response per prompt of the *global* batch and returns, per prompt in
order, ``(response_token_ids, response_logprobs)``:

* ``response_token_ids``: the sampled ids, at least one; a response that sampled one of
  ``stop_token_ids`` (EOS, the chat template's end of turn, ...: the trainer's set, from
  ``megatron_logra.data.prompt_builder``) ends with it (and is then "finished"); otherwise it
  stopped at ``max_new_tokens``. The engine stops at exactly the set it is given.
* ``response_logprobs``: one float per token, ``log softmax(z / T)[y_t]`` over the real
  vocabulary at the sampling temperature T, *untruncated* by top-p (T = 1 for greedy decoding,
  ``temperature = 0``). This is the ``pi_rollout`` of the RL losses and of the KL controller's
  rollout/trainer gap (``megatron_logra.rl.rollout`` defines it); it is all the RL step reads
  of a rollout besides the tokens.

``seed`` fixes the randomness: the Megatron engine draws with the counter-based uniforms of
``megatron_logra.rl.rollout.sampling_uniforms`` (seed, global sequence index, position), so its
samples equal the colocated sampler's for the same weights; vLLM seeds its own sampler.

**apply_sync** applies one record encoded by ``megatron_logra.sync.wire.encode`` (a low-rank
update, a dense non-target value or one bucket of a full sync) to the engine's exact shadow of
its weights and refreshes the weights it serves. A refused record (repeated, out of order, a
gap, a version the engine does not speak) raises an error that names the cause and changes
nothing.

**weight_checksums** returns ``megatron_logra.sync.checksum.weight_checksum`` of every served
weight in the engine's own naming and layout at TP=1, which **weight_layout** names:
``"megatron"`` (the Megatron engine: the trainer's names and fused layouts) or
``"huggingface"`` (vLLM: the Hugging Face checkpoint's names, q/k/v and gate/up split); the
trainer maps its own weights to that layout before it compares digests.

``start`` brings the engine up (raises, naming the cause, if it does not come up in time) and
``close`` shuts it down; both are idempotent.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

EngineResponse = tuple[list[int], list[float]]
"""``(response_token_ids, response_logprobs)`` of one prompt."""


@runtime_checkable
class GenerationEngine(Protocol):
    """A rollout engine outside the trainer's processes, kept in step by policy sync."""

    weight_layout: str
    """How ``weight_checksums`` names and lays out the weights: megatron or huggingface."""

    def start(self) -> None:
        """Start the engine (idempotent); an error naming the cause if it cannot."""
        ...

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        stop_token_ids: list[int],
    ) -> list[EngineResponse]:
        """One ``(response_token_ids, response_logprobs)`` per prompt, in prompt order."""
        ...

    def apply_sync(self, payload: bytes) -> None:
        """Apply one wire-encoded sync record (``megatron_logra.sync.wire``)."""
        ...

    def weight_checksums(self) -> dict[str, str]:
        """``weight_checksum`` of every served weight, by the engine's TP=1 name."""
        ...

    def close(self) -> None:
        """Shut the engine down (idempotent)."""
        ...
