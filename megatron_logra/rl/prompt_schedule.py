"""Which prompts each RL step trains on, independent of the parallel layout.

Step ``k`` takes prompts ``k*P .. (k+1)*P - 1`` of an endless sequence of seeded permutations of
the training problems, and repeats each ``n`` times consecutively (a GRPO group stays together in
the global batch). Every rank computes the same global list; the rollout engine gives each
data-parallel rank its contiguous share.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_logra.data.prompt_data import PromptProblem


class PromptSchedule:
    def __init__(
        self, problems: Sequence[PromptProblem], *, prompts_per_step: int,
        samples_per_prompt: int, seed: int,
    ) -> None:
        if len(problems) < prompts_per_step:
            raise ValueError(
                f"{len(problems)} training problems are fewer than rl.prompts_per_step="
                f"{prompts_per_step}"
            )
        self.problems = list(problems)
        self.prompts_per_step = prompts_per_step
        self.samples_per_prompt = samples_per_prompt
        self.seed = seed
        self._order: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._order:
            rng = np.random.default_rng([self.seed, 0x52_4C, epoch])
            self._order = {epoch: rng.permutation(len(self.problems))}
        return self._order[epoch]

    def step_problems(self, step: int) -> list[PromptProblem]:
        """The global batch of step ``step`` (0-based): P prompts, each repeated n times."""
        flat = np.arange(step * self.prompts_per_step, (step + 1) * self.prompts_per_step)
        epochs, offsets = np.divmod(flat, len(self.problems))
        chosen = [self.problems[int(self._permutation(int(e))[int(o)])]
                  for e, o in zip(epochs, offsets, strict=True)]
        return [problem for problem in chosen for _ in range(self.samples_per_prompt)]
