"""Prompt/answer problems and the supervised (warm-start) batches built from them.

A supervised sample is the prompt's token ids exactly as rollouts see them, then the target's
ids and its stop token (``megatron_logra.data.prompt_builder`` builds both); the loss is on the
target and the stop token only. Files are read by ``megatron_logra.data.problem_files``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from megatron_logra.data.lm_batches import BatchSchedule
from megatron_logra.data.sample_order import SampleOrder


@dataclass(frozen=True)
class PromptProblem:
    prompt: str
    """The user's text (a messages prompt's last user turn)."""
    answer: str
    """What the reward grades a response against."""
    context: tuple[tuple[str, str], ...] = ()
    """``(role, content)`` turns before the prompt (a messages row's system / earlier turns)."""
    response: str | None = None
    """The supervised target; None: the answer."""
    origin: str = field(default="", compare=False)
    """Where the row came from (``file:line``), for error messages."""

    @property
    def target(self) -> str:
        return self.answer if self.response is None else self.response


class SupervisedTokens(Protocol):
    @property
    def pad_id(self) -> int: ...

    def supervised_tokens(self, problem: PromptProblem) -> tuple[list[int], int]:
        """``(prompt ids + target ids + [stop], number of prompt ids)``."""
        ...


class SupervisedBatchSchedule(BatchSchedule):
    """Layout-independent supervised batches over a problem list (which problems a step and a
    data-parallel rank use is :class:`SampleOrder`'s, as for LMBatchSchedule)."""

    def __init__(
        self, problems: list[PromptProblem], builder: SupervisedTokens, *, seq_length: int,
        global_batch_size: int, seed: int,
    ) -> None:
        if len(problems) < global_batch_size:
            raise ValueError(
                f"{len(problems)} problems are fewer than one global batch of "
                f"{global_batch_size}; lower train.global_batch_size"
            )
        self.seq_length = seq_length
        self.pad_id = builder.pad_id
        self.samples = []
        for problem in problems:
            ids, prompt_len = builder.supervised_tokens(problem)
            if len(ids) > seq_length + 1:
                raise ValueError(
                    f"{problem.origin or repr(problem.prompt)} takes {len(ids)} tokens with its "
                    f"target and stop token, more than model.seq_length + 1 = {seq_length + 1}; "
                    "raise model.seq_length"
                )
            self.samples.append((ids, prompt_len))
        self.num_samples = len(self.samples)
        self.order = SampleOrder(self.num_samples, global_batch_size=global_batch_size, seed=seed)

    def windows(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.full((len(indices), self.seq_length + 1), self.pad_id, dtype=torch.int64)
        mask = torch.zeros(len(indices), self.seq_length, dtype=torch.float32)
        for row, index in enumerate(indices):
            ids, prompt_len = self.samples[int(index)]
            window[row, : len(ids)] = torch.tensor(ids)
            # Label position t predicts token t+1: target tokens and the stop are the labels at
            # positions prompt_len-1 .. len(ids)-2.
            mask[row, prompt_len - 1 : len(ids) - 1] = 1.0
        return window, mask
