"""``<run.dir>/rollouts.jsonl``: a few responses of every RL step as the model saw and wrote
them, so a user can read what the chat template, the system prompt and the stop tokens did.

One line per response: the step, its index in the global batch, the prompt text the ids
encode (the rendered chat template included), the prompt and response ids, the response text
the reward graded, the reference answer, the reward and whether the response ended with a stop
token. World rank 0 writes the first responses of its share (the first of the global batch).
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_logra.atomic_write import write_atomically
from megatron_logra.data.prompt_builder import PromptBuilder
from megatron_logra.data.prompt_data import PromptProblem
from megatron_logra.train.rl.rollouts import ScoredRollouts

ROLLOUTS_FILE = "rollouts.jsonl"


def rollout_records(step: int, problems: list[PromptProblem], scored: ScoredRollouts,
                    builder: PromptBuilder, count: int) -> list[dict]:
    rollout = scored.rollout
    records = []
    for row, index in enumerate(rollout.sequence_indices[:count]):
        problem = problems[index]
        length = int(rollout.response_lengths[row])
        records.append({
            "step": step,
            "index": index,
            "prompt": builder.prompt_text(problem),
            "prompt_ids": list(rollout.prompt_tokens[row]),
            "response": scored.texts[row],
            "response_ids": rollout.response_tokens[row, :length].tolist(),
            "answer": problem.answer,
            "reward": scored.rewards[index],
            "finished": bool(rollout.finished[row]),
        })
    return records


def append_rollouts(run_dir: Path, records: list[dict]) -> None:
    with open(Path(run_dir) / ROLLOUTS_FILE, "a") as handle:
        handle.write("".join(json.dumps(record) + "\n" for record in records))


def keep_rollouts_up_to(run_dir: Path, step: int) -> None:
    """A fresh run starts a new log; a resumed one keeps the steps up to its checkpoint."""
    path = Path(run_dir) / ROLLOUTS_FILE
    if step == 0 or not path.is_file():
        path.unlink(missing_ok=True)
        return
    kept = [r for r in read_rollouts(run_dir) if r["step"] <= step]
    write_atomically(path, "".join(json.dumps(r) + "\n" for r in kept))


def read_rollouts(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / ROLLOUTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
