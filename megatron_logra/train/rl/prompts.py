"""Prompts to token ids and responses back to text, for the rollout engine and the reward."""

from __future__ import annotations

from typing import Any

from megatron_logra.data.prompt_data import PromptProblem
from megatron_logra.rl.rollout import RolloutBatch


class PromptEncoder:
    """Token ids of prompts, cached (the same problems recur across epochs)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[str, list[int]] = {}

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    def prompt_ids(self, problems: list[PromptProblem]) -> list[list[int]]:
        out = []
        for problem in problems:
            if problem.prompt not in self._cache:
                self._cache[problem.prompt] = self.tokenizer.encode(problem.prompt)
            out.append(self._cache[problem.prompt])
        return out

    def response_texts(self, rollout: RolloutBatch) -> list[str]:
        eos = self.tokenizer.eos_id
        texts = []
        for tokens in rollout.responses():
            if tokens and tokens[-1] == eos:
                tokens = tokens[:-1]
            texts.append(self.tokenizer.decode(tokens))
        return texts
