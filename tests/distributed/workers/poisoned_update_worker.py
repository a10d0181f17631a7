"""A NaN at any stage of a step must stop it on every rank before any weight moves (torchrun).

One job, run with 2 processes (TP=2), measures every stage, so Megatron is imported once:

* optimizer stages, in paper mode (KL control) and in library mode (a native Adam chained):
  ``sketch`` (a reduced sketch entry), ``direction`` (after the direction rule), ``ratio``
  (paper: the update-ratio factor, via ``update_ratio = nan``), ``alpha`` (the step scale),
  ``factor`` (a merged factor ``U`` overflowing), ``native_grad`` (library: a NaN gradient of a
  non-target parameter, as a NaN loss gives). The poison is put on TP rank 1 only: rank 0 must
  refuse too (else it would apply its half of the update and then hang in a collective);
* RL stages through :class:`RLJob`: ``reward`` (the reward returns NaN) and ``loss`` (the
  rollout engine returns NaN log-probs, so the loss is NaN), on every rank.

For each stage the report holds the error of every rank, whether every parameter and the row
moments are bit-identical to before, and the update count. A final clean step must then succeed
and move the weights (the refusals left a working optimizer).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from harness import Case, run_worker

from megatron_logra.config import load_config
from megatron_logra.data.dataset_dir import load_tokenizer, load_tokens
from megatron_logra.data.lm_batches import LMBatchSchedule
from megatron_logra.mcore.models.gpt import build_model_chunks
from megatron_logra.mcore.training.forward_backward import forward_backward
from megatron_logra.mcore.training.setup import setup_training
from megatron_logra.mcore.training.step import _forward_step
from megatron_logra.probe_batch import ProbeBatch
from megatron_logra.train.rl.job import RLJob
from tests.presets import tiny_gpt, tiny_kl_controlled_logra
from tests.torchrun import REPO

RL_CONFIG = REPO / "configs" / "demo_rl_cpu.yaml"
POISON_RANK = 1


def rl_cfg(args, world: int):
    overrides = [
        f"parallel.tp={world}", *tiny_gpt(), "train.steps=1", "train.micro_batch_size=4",
        "rl.prompts_per_step=4", "rl.sampling.max_new_tokens=4", "rl.eval.prompts=4",
        "logra.kl_control.probe_responses=2", f"data.dir={args.data}",
        f"run.dir={args.out / 'rl'}",
    ]
    return load_config(RL_CONFIG, overrides, command="rl").resolved(world, "rl")


def lm_cfg(args, world: int, mode: str):
    return load_config(None, tiny_kl_controlled_logra(world, mode, args.data)).resolved(world)


def _snapshot(chunks, logra):
    params = {name: p.detach().clone() for chunk in chunks for name, p in chunk.named_parameters()}
    moments = {k: v.clone() for k, v in logra.direction.state_tensors().items()}
    return params, moments


def _unchanged(before, chunks, logra) -> bool:
    params, moments = before
    now = {name: p.detach() for chunk in chunks for name, p in chunk.named_parameters()}
    state = logra.direction.state_tensors()
    return (all(torch.equal(params[n], now[n]) for n in params)
            and all(torch.equal(moments[k], state[k]) for k in moments))


def _errors(error: str | None) -> list[str | None]:
    """Every rank's error (None: that rank did not raise)."""
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)
    return gathered


class _FixedScale:
    """A step scale returning ``alpha`` (per rank) instead of the KL control's choice."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha

    def __call__(self, proposal) -> float:
        return self.alpha

    def state_dict(self):
        return {}

    def load_state_dict(self, state) -> None:
        pass


def optimizer_stages(args, mode: str, groups):
    cfg = lm_cfg(args, groups.world_size, mode)
    tokenizer = load_tokenizer(cfg.data.dir)
    schedule = LMBatchSchedule(load_tokens(cfg.data.dir), seq_length=32, global_batch_size=4,
                               seed=cfg.train.seed)
    setup = setup_training(cfg, build_model_chunks(cfg, groups, tokenizer.vocab_size), groups,
                           kl_vocab_size=tokenizer.vocab_size)
    logra, control = setup.logra, setup.kl_control
    poisoned = groups.world_rank == POISON_RANK

    def backward(step: int) -> None:
        for chunk in setup.model_chunks:
            chunk.zero_grad_buffer()
        setup.optimizer.zero_grad()
        batches = schedule.microbatches(step, dp_rank=0, dp_size=1, micro_batch_size=4)
        control.set_batch(ProbeBatch.from_rows(batches[0].tokens, batches[0].position_ids,
                                               batches[0].loss_mask > 0))
        forward_backward(setup.model_chunks, batches, _forward_step, seq_length=32,
                         micro_batch_size=4)

    def poison_direction():
        rule_apply = logra.direction.apply_

        def apply_(sketches, context):
            rule_apply(sketches, context)
            if poisoned:
                sketches.data[5] = float("nan")
        logra.direction.apply_ = apply_
        return lambda: vars(logra.direction).pop("apply_")

    def poison_ratio():
        logra.mode.update_ratio = float("nan") if poisoned else logra.mode.update_ratio
        original = cfg.logra.update_ratio
        return lambda: setattr(logra.mode, "update_ratio", original)

    def poison_alpha():
        logra.step_scale = _FixedScale(float("nan") if poisoned else 1.0)
        return lambda: setattr(logra, "step_scale", control)

    def poison_factor():
        merge = logra.mode.merge_factor

        def merge_factor(direction, scale, lr):
            factor, step_lr = merge(direction, scale, lr)
            if poisoned:
                factor = factor.clone()
                factor.view(-1)[0] = float("inf")  # as a bf16 rounding of alpha * D overflows
            return factor, step_lr
        logra.mode.merge_factor = merge_factor
        return lambda: vars(logra.mode).pop("merge_factor")

    def poison_native_grad():
        if poisoned:
            trained = [p for chunk in setup.model_chunks for p in chunk.parameters()
                       if p.requires_grad]
            trained[0].main_grad.view(-1)[0] = float("nan")
        return lambda: None

    def poison_sketch():
        if poisoned:
            logra.sketches.data[3] = float("nan")
        return lambda: None

    stages = {"sketch": poison_sketch, "direction": poison_direction, "alpha": poison_alpha,
              "factor": poison_factor}
    if mode == "paper":
        stages["ratio"] = poison_ratio
    else:
        stages["native_grad"] = poison_native_grad
    report = {}
    for step, (stage, poison) in enumerate(stages.items()):
        backward(step)
        before = _snapshot(setup.model_chunks, logra)
        undo = poison()
        error = None
        try:
            setup.optimizer.step()
        except RuntimeError as exc:
            error = str(exc)
        undo()
        report[stage] = {"errors": _errors(error),
                         "unchanged": _unchanged(before, setup.model_chunks, logra),
                         "update_count": logra.update_count}
    backward(len(stages))
    before = _snapshot(setup.model_chunks, logra)
    setup.optimizer.step()
    report["clean_step"] = {"unchanged": _unchanged(before, setup.model_chunks, logra),
                            "update_count": logra.update_count}
    return report


def rl_stages(job: RLJob):
    chunks, logra = job.setup.model_chunks, job.setup.logra
    score, generate = job.reward.score, job.engine.generate

    def nan_reward(responses, answers):
        result = score(responses, answers)
        return dataclasses.replace(result, rewards=[float("nan")] * len(result.rewards))

    def nan_logprobs(*args, **kwargs):
        rollout = generate(*args, **kwargs)
        return dataclasses.replace(rollout, logprobs=torch.full_like(rollout.logprobs,
                                                                     float("nan")))

    report = {}
    for stage, (target, name, fake) in {"reward": (job.reward, "score", nan_reward),
                                        "loss": (job.engine, "generate", nan_logprobs)}.items():
        before = _snapshot(chunks, logra)
        setattr(target, name, fake)
        error = None
        try:
            job.step(0)
        except RuntimeError as exc:
            error = str(exc)
        vars(target).pop(name)
        report[stage] = {"errors": _errors(error), "unchanged": _unchanged(before, chunks, logra),
                         "update_count": logra.update_count}
    return report


def measure(args, cfg, groups):
    report = {mode: optimizer_stages(args, mode, groups) for mode in ("paper", "library")}
    job = RLJob(cfg, groups)
    try:
        report["rl"] = rl_stages(job)
    finally:
        job.close()
    return report


def add_arguments(parser) -> None:
    parser.add_argument("--data", required=True)


if __name__ == "__main__":
    run_worker({"poisoned_update": Case(rl_cfg, measure, world_sizes=(2,))}, add_arguments)
