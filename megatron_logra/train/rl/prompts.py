"""Prompts to token ids and responses back to text, for the rollout engine and the reward (the
ids and the stop tokens are :class:`~megatron_logra.data.prompt_builder.PromptBuilder`'s)."""

from __future__ import annotations

from megatron_logra.data.prompt_builder import PromptBuilder
from megatron_logra.data.prompt_data import PromptProblem
from megatron_logra.rl.rollout import RolloutBatch


class PromptEncoder:
    """Token ids of prompts (the builder caches them: the same problems recur across epochs)."""

    def __init__(self, builder: PromptBuilder) -> None:
        self.builder = builder

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.builder.stop_ids

    @property
    def pad_id(self) -> int:
        return self.builder.pad_id

    def prompt_ids(self, problems: list[PromptProblem]) -> list[list[int]]:
        return [self.builder.prompt_ids(problem) for problem in problems]

    def response_texts(self, rollout: RolloutBatch) -> list[str]:
        return [self.builder.response_text(tokens) for tokens in rollout.responses()]
