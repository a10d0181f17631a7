"""Prompt/answer data: JSONL problems and supervised (warm-start) batches built from them.

A problem file holds one ``{"prompt": ..., "answer": ...}`` object per line. For supervised
training a sample is ``prompt + " " + answer`` followed by EOS, with the loss on the answer and
EOS tokens only. The answer's tokens are taken as the tail of the tokenized whole after the
tokenized prompt, so that what the model learns to continue is exactly what it sees when it is
prompted with the tokenized prompt at rollout time (this is checked, not assumed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from megatron_logra.data.lm_batches import BatchSchedule
from megatron_logra.data.sample_order import SampleOrder


@dataclass(frozen=True)
class PromptProblem:
    prompt: str
    answer: str


class TextTokenizer(Protocol):
    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...


def load_problems(path: str | Path) -> list[PromptProblem]:
    """Read a JSONL problem file; every line needs a string ``prompt`` and ``answer``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"problem file {str(path)!r} does not exist; create the dataset with "
                         "tools/make_synthetic_data.py")
    problems = []
    with open(path) as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number} is not JSON ({error})") from error
            if not isinstance(item.get("prompt"), str) or not isinstance(item.get("answer"), str):
                raise ValueError(
                    f"{path}:{number} needs string fields 'prompt' and 'answer', got "
                    f"{sorted(item)}"
                )
            problems.append(PromptProblem(item["prompt"], item["answer"]))
    if not problems:
        raise ValueError(f"problem file {path} is empty")
    return problems


def supervised_tokens(problem: PromptProblem, tokenizer: TextTokenizer) -> tuple[list[int], int]:
    """``(prompt ids + answer ids + [eos], number of prompt ids)``."""
    prompt_ids = tokenizer.encode(problem.prompt)
    whole = tokenizer.encode(f"{problem.prompt} {problem.answer}")
    if whole[: len(prompt_ids)] != prompt_ids:
        raise ValueError(
            f"the tokenization of {problem.prompt!r} is not a prefix of the tokenized "
            "prompt-plus-answer; supervised targets would not match what rollouts see"
        )
    return whole + [tokenizer.eos_id], len(prompt_ids)


class SupervisedBatchSchedule(BatchSchedule):
    """Layout-independent supervised batches over a problem list (which problems a step and a
    data-parallel rank use is :class:`SampleOrder`'s, as for LMBatchSchedule)."""

    def __init__(
        self, problems: list[PromptProblem], tokenizer: TextTokenizer, *, seq_length: int,
        global_batch_size: int, seed: int,
    ) -> None:
        if len(problems) < global_batch_size:
            raise ValueError(
                f"{len(problems)} problems are fewer than one global batch of "
                f"{global_batch_size}; lower train.global_batch_size"
            )
        self.seq_length = seq_length
        self.pad_id = tokenizer.pad_id
        self.samples = []
        for problem in problems:
            ids, prompt_len = supervised_tokens(problem, tokenizer)
            if len(ids) > seq_length + 1:
                raise ValueError(
                    f"problem {problem.prompt!r} takes {len(ids)} tokens with its answer and "
                    f"EOS, more than model.seq_length + 1 = {seq_length + 1}; raise "
                    "model.seq_length"
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
            # Label position t predicts token t+1: answer tokens and EOS are the labels at
            # positions prompt_len-1 .. len(ids)-2.
            mask[row, prompt_len - 1 : len(ids) - 1] = 1.0
        return window, mask
