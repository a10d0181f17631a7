"""Which prompts each RL step trains on, independent of the parallel layout.

Step ``k`` takes prompts ``k*P .. (k+1)*P - 1`` of an endless sequence of seeded permutations of
the training problems (:class:`SampleOrder`, with its own random stream), and repeats each ``n`` times consecutively (a GRPO group stays together in
the global batch). Every rank computes the same global list; the rollout engine gives each
data-parallel rank its contiguous share.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_logra.data.prompt_data import PromptProblem
from megatron_logra.data.sample_order import SampleOrder

# The RL prompt order's own random stream ("RL"), apart from the supervised sample order.
RL_PROMPT_STREAM = 0x52_4C


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
        self.samples_per_prompt = samples_per_prompt
        self.order = SampleOrder(len(self.problems), global_batch_size=prompts_per_step,
                                 seed=seed, stream=(RL_PROMPT_STREAM,))

    def step_problems(self, step: int) -> list[PromptProblem]:
        """The global batch of step ``step`` (0-based): P prompts, each repeated n times."""
        chosen = [self.problems[int(i)] for i in self.order.global_batch_indices(step)]
        return [problem for problem in chosen for _ in range(self.samples_per_prompt)]
