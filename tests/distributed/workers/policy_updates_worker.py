"""Several GRPO updates per rollout batch make the ratio and its clip act (run with torchrun).

Builds the real RL job (tiny GPT, paper-mode LoGRA with the KL step control, the GRPO loss with
a tight clip) and runs one real step -- sampling, log-probs, Megatron's schedule, the optimizer
-- with ``rl.updates_per_rollout`` = 1 and = 2. A randomly initialised model solves nothing, so
every group's rewards tie and GRPO's advantages are all zero: the advantage estimator is
replaced by fixed alternating +-1 advantages (nothing else is faked). Writes each step record.
"""

from __future__ import annotations

import torch
from harness import Case, run_worker

from megatron_logra.config import load_config
from megatron_logra.train.rl.job import RLJob
from tests.presets import tiny_gpt
from tests.torchrun import REPO

RL_CONFIG = REPO / "configs" / "demo_rl_cpu.yaml"


def overrides(args, world: int, updates: int) -> list[str]:
    return [
        f"parallel.tp={world}", *tiny_gpt(), "train.steps=1", "train.micro_batch_size=4",
        "rl.prompts_per_step=4", "rl.samples_per_prompt=2", "rl.sampling.max_new_tokens=4",
        "rl.loss.name=grpo", f"rl.loss.grpo.clip_low={args.clip}",
        f"rl.loss.grpo.clip_high={args.clip}", f"rl.updates_per_rollout={updates}",
        "logra.kl_control.probe_responses=2", f"data.dir={args.data}",
        f"run.dir={args.out / f'updates{updates}'}",
    ]


def cfg_for(args, world: int, updates: int = 1):
    cfg = load_config(RL_CONFIG, overrides(args, world, updates), command="rl")
    return cfg.resolved(world, "rl")


def measure(args, cfg, groups):
    report = {}
    for updates in (1, 2):
        job = RLJob(cfg_for(args, groups.world_size, updates), groups)
        try:
            def fixed(*, rewards, correct, lengths):
                del correct, lengths
                return torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(rewards))])
            job.preset.advantages.compute = fixed
            record = job.step(0)
        finally:
            job.close()
        report[f"updates_{updates}"] = {
            key: record[key] for key in ("clip_fraction", "ratio_mean", "loss", "alpha")
        } | {"update_count": job.setup.logra.update_count}
    return report


def add_arguments(parser) -> None:
    parser.add_argument("--data", required=True)
    parser.add_argument("--clip", type=float, required=True)


if __name__ == "__main__":
    run_worker({"policy_updates": Case(cfg_for, measure)}, add_arguments)
