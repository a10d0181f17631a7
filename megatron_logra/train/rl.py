"""RL post-training on Megatron (``megatron-logra rl``): rollouts -> rewards -> advantages -> loss
-> microbatched forward/backward through Megatron's schedule -> LoGRA (or Adam) step.

One step, on every rank:

1. the step's global prompt list (``rl.prompts_per_step`` prompts x ``rl.samples_per_prompt``);
   the rollout engine samples this data-parallel rank's share with the current weights;
2. rewards of the share; correctness and lengths are gathered over DP, and advantages are
   computed on the whole global batch (a running baseline or group normalisation), identically on
   every rank;
3. the policy loss (``paper`` or ``grpo``) in Megatron's per-token convention: each microbatch
   returns its loss sum and token count, ``finalize_model_grads`` divides by the global count;
4. the rollout-vs-trainer log-prob gap on completed responses feeds the KL controller's mismatch
   term; the LoGRA optimizer prepares its update, the controller predicts its KL on the first
   responses of the global batch (generated positions only) and scales it, it is applied, and the
   realised KL is measured.

Held-out evaluation (pass@1 and pass@k over ``rl.eval_samples`` samples, and greedy accuracy)
runs before training, every ``rl.eval_interval`` steps and at the end; each evaluation's
per-problem answers go to ``<run.dir>/eval/step_NNNNNN.jsonl``. Rank 0 prints one line per
step and writes metrics.jsonl; checkpoints hold the RL state (running baseline) too; PNG plots of
the curves are written at the end.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_logra.config import Config
from megatron_logra.data.prompt_data import PromptProblem, load_problems
from megatron_logra.data.run_tokenizer import embedding_rows, load_run_tokenizer
from megatron_logra.mcore.checkpointing.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
    save_model_checkpoint,
)
from megatron_logra.mcore.inference.sampler import MegatronSampler
from megatron_logra.mcore.inference.token_logprobs import (
    compute_token_logprobs,
    token_logprobs_from_logits,
)
from megatron_logra.mcore.kl_probe.step_control import KLStepControl, ProbeBatch
from megatron_logra.mcore.models.gpt import build_model_chunks
from megatron_logra.mcore.process_groups import ParallelGroups, destroy_parallel, init_parallel
from megatron_logra.mcore.training.setup import TrainingSetup, setup_training
from megatron_logra.mcore.training.state_bytes import gather_state_bytes, write_state_bytes
from megatron_logra.rl.advantages import (
    GroupAdvantageConfig,
    PaperAdvantageConfig,
    RunningBaselineAdvantage,
    group_normalized_advantages,
)
from megatron_logra.rl.eval_answers import EvalAnswer, eval_answers_path, write_eval_answers
from megatron_logra.rl.losses import (
    GrpoLossConfig,
    PaperLossConfig,
    grpo_policy_loss,
    paper_policy_loss,
    rollout_mismatch_sums,
)
from megatron_logra.rl.pass_at_k import mean_pass_at_k
from megatron_logra.rl.prompt_schedule import PromptSchedule
from megatron_logra.rl.rewards import RewardConfig, build_reward
from megatron_logra.rl.rollout import (
    PaddedRollout,
    RolloutBatch,
    SamplingParams,
    data_parallel_share,
)
from megatron_logra.train.metric_sinks import metric_sinks
from megatron_logra.train.metrics import MetricsLog, peak_rss_bytes
from megatron_logra.train.plots import plot_metrics
from megatron_logra.train.preemption import PreemptionFlag
from megatron_logra.train.supervised import (
    MODEL_DIR,
    RESOLVED_CONFIG_FILE,
    STATE_BYTES_FILE,
    _keep_metrics_up_to,
)

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
# Fixed so every evaluation samples the same way: differences between evaluations are the model's.
EVAL_SEED = 2_000_003


@dataclass(frozen=True)
class _RLMicrobatch:
    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    reference_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    finished: torch.Tensor


class _Encoder:
    """Token ids of prompts, cached (the same problems recur across epochs)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[str, list[int]] = {}

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


def rl(cfg: Config) -> dict[str, Any]:
    """Run ``cfg.train.steps`` RL steps; returns the last metrics record."""
    groups = init_parallel(cfg)
    try:
        return _rl(cfg, groups)
    finally:
        destroy_parallel()


def _gather_dp(values: list[Any], groups: ParallelGroups) -> list[Any]:
    """Concatenate every DP rank's list, in DP-rank order (= global index order)."""
    gathered: list[list[Any] | None] = [None] * groups.dp_size
    dist.all_gather_object(gathered, values, group=groups.dp)
    return [item for part in gathered for item in (part or [])]


def _replica_sum(values: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Sum over the data-parallel replicas of quantities held by the last pipeline stage (the
    same on every TP rank): TP rank 0 of the last stage contributes, summed over the world."""
    total = values.clone().to(torch.float64)
    if not (groups.is_last_stage() and groups.tp_rank == 0):
        total.zero_()
    dist.all_reduce(total)
    return total


def _rl(cfg: Config, groups: ParallelGroups) -> dict[str, Any]:
    r = cfg.rl
    is_rank0 = groups.world_rank == 0
    run_dir = Path(cfg.run.dir)
    tokenizer = load_run_tokenizer(cfg)
    encoder = _Encoder(tokenizer)
    train_problems = load_problems(Path(cfg.data.dir) / "train.jsonl")
    eval_problems = load_problems(Path(cfg.data.dir) / "eval.jsonl")[: r.eval_prompts]
    schedule = PromptSchedule(train_problems, prompts_per_step=r.prompts_per_step,
                              samples_per_prompt=r.samples_per_prompt, seed=r.seed)
    chunks = build_model_chunks(cfg, groups, vocab_size=embedding_rows(cfg, tokenizer))
    if cfg.model.init_checkpoint:
        load_model_weights(cfg.model.init_checkpoint, model_chunks=chunks, cfg=cfg,
                           groups=groups, verify=cfg.checkpoint.verify)
    reference = None
    if r.loss == "grpo" and r.kl_beta > 0:
        # A frozen copy of the starting policy for the k3 reference KL.
        reference = build_model_chunks(cfg, groups, vocab_size=embedding_rows(cfg, tokenizer))
        for ref_chunk, chunk in zip(reference, chunks, strict=True):
            ref_chunk.load_state_dict(chunk.state_dict())
            ref_chunk.requires_grad_(False)
    setup = setup_training(cfg, chunks, groups)
    sampler = MegatronSampler(setup.model_chunks, groups, vocab_size=tokenizer.vocab_size)
    control = None
    if cfg.logra.kl_control:
        control = KLStepControl(setup.model_chunks, settings=cfg.kl_control, groups=groups,
                                vocab_size=tokenizer.vocab_size)
        control.temperature = r.temperature
        setup.logra.kl_controller = control.controller
    estimator = RunningBaselineAdvantage(PaperAdvantageConfig(
        failure_reward=r.failure_reward, running_baseline_weight=r.running_baseline_weight,
        response_length_reference=r.response_length_reference,
    )) if r.loss == "paper" else None
    reward = build_reward(RewardConfig(name=r.reward))
    start_step = 0
    if cfg.checkpoint.resume:
        path = latest_checkpoint(cfg.checkpoint.dir)
        if path is None:
            logger.warning("checkpoint.resume=true but %s holds no complete checkpoint: "
                           "starting from step 0", cfg.checkpoint.dir)
        else:
            common = load_checkpoint(path, setup=setup, cfg=cfg, groups=groups,
                                     verify=cfg.checkpoint.verify)
            start_step = int(common["step"])
            if estimator is not None:
                estimator.load_state_dict(common["rl"]["advantage"])
    if is_rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        _keep_metrics_up_to(run_dir / METRICS_FILE, start_step)
        (run_dir / RESOLVED_CONFIG_FILE).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    log = MetricsLog(run_dir / METRICS_FILE if is_rank0 else None, total_steps=cfg.train.steps,
                     console=sys.stdout if is_rank0 else None,
                     sinks=metric_sinks(cfg) if is_rank0 else ())
    def evaluate(step: int) -> dict[str, float]:
        metrics, answers = _evaluate(cfg=cfg, sampler=sampler, encoder=encoder, reward=reward,
                                     problems=eval_problems, groups=groups)
        if is_rank0:
            write_eval_answers(answers, eval_answers_path(run_dir, step))
        return metrics

    record: dict[str, Any] = {}
    state_bytes: list[dict[str, int]] | None = None
    ckpt = cfg.checkpoint
    try:
        with log, PreemptionFlag() as preemption:
            if start_step == 0:
                initial = {"step": 0, **evaluate(0)}
                if is_rank0:
                    log.log(initial)
            for step in range(start_step, cfg.train.steps):
                record = _rl_step(cfg, setup, sampler, encoder, reward, schedule, estimator,
                                  control, reference, groups, step)
                if state_bytes is None:
                    # After the first step: Adam allocates its moments lazily.
                    state_bytes = gather_state_bytes(setup, groups)
                    record["state_bytes"] = sum(sum(rank.values()) for rank in state_bytes)
                completed = step + 1
                if completed == cfg.train.steps or (
                    r.eval_interval and completed % r.eval_interval == 0
                ):
                    record.update(evaluate(completed))
                if is_rank0:
                    log.log(record)
                preempted = preemption.agreed(groups.device)
                exiting = cfg.train.exit_interval and (
                    completed - start_step >= cfg.train.exit_interval
                )
                due = ckpt.interval and completed % ckpt.interval == 0
                if ckpt.dir and (due or preempted or exiting or completed == cfg.train.steps):
                    extra = {"rl": {"advantage": estimator.state_dict() if estimator else None}}
                    save_checkpoint(ckpt.dir, step=completed, setup=setup, cfg=cfg,
                                    groups=groups, extra_common=extra)
                if preempted or exiting:
                    logger.warning("stopping after step %d (%s)", completed,
                                   "SIGTERM" if preempted else "train.exit_interval")
                    break
    finally:
        reward.close()
    if is_rank0 and state_bytes is not None:
        write_state_bytes(state_bytes, cfg.optimizer.name, run_dir / STATE_BYTES_FILE)
    if cfg.run.save_model:
        save_model_checkpoint(run_dir, model_chunks=setup.model_chunks, cfg=cfg, groups=groups,
                              name=MODEL_DIR)
    if is_rank0:
        for path in plot_metrics(run_dir / METRICS_FILE):
            logger.info("plot: %s", path)
    return record


def _sampling(
    cfg: Config, eos_id: int, *, evaluation: bool, greedy: bool = False
) -> SamplingParams:
    r = cfg.rl
    if greedy:
        temperature, top_p = 0.0, 1.0
    elif evaluation:
        temperature, top_p = r.eval_temperature, r.eval_top_p
    else:
        temperature, top_p = r.temperature, r.top_p
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=temperature, top_p=top_p,
                          eos_id=eos_id)


def _padded(rollout: RolloutBatch, cfg: Config, pad_id: int) -> PaddedRollout:
    """The trainer's view of the rollout, padded to model.seq_length (fixed shapes for the
    pipeline schedules; a multiple of TP under sequence parallelism)."""
    padded = rollout.to_padded(pad_id)
    length = cfg.model.seq_length
    if padded.tokens.shape[1] > length:
        raise ValueError(
            f"a prompt plus its response takes {padded.tokens.shape[1]} tokens, more than "
            f"model.seq_length={length}; raise model.seq_length or lower rl.max_new_tokens"
        )
    extra = length - padded.tokens.shape[1]

    def widen(tensor: torch.Tensor, value: float | int | bool) -> torch.Tensor:
        return torch.nn.functional.pad(tensor, (0, extra), value=value)

    return PaddedRollout(
        tokens=widen(padded.tokens, pad_id),
        labels=widen(padded.labels, pad_id),
        position_ids=torch.arange(length, dtype=torch.int64)[None, :].repeat(len(rollout), 1),
        response_mask=widen(padded.response_mask, False),
        rollout_logprobs=widen(padded.rollout_logprobs, 0.0),
        sampling_logprobs=widen(padded.sampling_logprobs, 0.0),
        prompt_lengths=padded.prompt_lengths,
        response_lengths=padded.response_lengths,
        finished=padded.finished,
        logprob_temperature=padded.logprob_temperature,
    )


def _rl_forward_step(
    data_iterator: Iterator[_RLMicrobatch], model: torch.nn.Module, *, cfg: Config,
    vocab_size: int, tp_rank: int, temperature: float,
) -> tuple[Any, Any]:
    batch = next(data_iterator)
    output = model(batch.tokens, batch.position_ids, None)

    def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        logprobs = token_logprobs_from_logits(logits, batch.labels, temperature=temperature,
                                              vocab_size=vocab_size, tp_rank=tp_rank)
        r = cfg.rl
        if r.loss == "paper":
            loss = paper_policy_loss(
                logprobs, batch.rollout_logprobs, batch.advantages, batch.response_mask,
                config=PaperLossConfig(importance_weight_cap=r.importance_weight_cap),
            )
            ratio_sum = loss.metrics["importance_weight_sum"]
        else:
            loss = grpo_policy_loss(
                logprobs, logprobs.detach(), batch.advantages, batch.response_mask,
                config=GrpoLossConfig(clip_low=r.clip_low, clip_high=r.clip_high,
                                      kl_beta=r.kl_beta),
                reference_logprobs_BL=batch.reference_logprobs,
            )
            ratio_sum = loss.metrics["ratio_sum"]
        gap = rollout_mismatch_sums(logprobs.detach(), batch.rollout_logprobs,
                                    batch.response_mask, batch.finished)
        # The same gap over every generated token (not only completed responses): a direct
        # check that the sampler and the trainer agree on the policy.
        every = rollout_mismatch_sums(logprobs.detach(), batch.rollout_logprobs,
                                      batch.response_mask, torch.ones_like(batch.finished))
        report = torch.stack([
            loss.loss_sum.detach().double(), loss.num_tokens.double(), ratio_sum.double(),
            gap.gap_sum.double(), torch.as_tensor(gap.num_tokens, dtype=torch.float64),
            every.gap_sum.double(), torch.as_tensor(every.num_tokens, dtype=torch.float64),
        ])
        return loss.loss_sum, loss.num_tokens.to(torch.int), {"rl": report}

    return output, loss_func


def _rl_step(
    cfg: Config, setup: TrainingSetup, sampler: MegatronSampler, encoder: _Encoder,
    reward: Any, schedule: PromptSchedule, estimator: RunningBaselineAdvantage | None,
    control: KLStepControl | None, reference: list[torch.nn.Module] | None,
    groups: ParallelGroups, step: int,
) -> dict[str, Any]:
    r = cfg.rl
    start = time.perf_counter()
    problems = schedule.step_problems(step)
    prompt_ids = encoder.prompt_ids(problems)
    eos_id = encoder.tokenizer.eos_id
    rollout = sampler.generate(prompt_ids, _sampling(cfg, eos_id, evaluation=False),
                               seed=_step_seed(r.seed, step))
    share = data_parallel_share(len(problems), groups.dp_rank, groups.dp_size)
    answers = [problems[i].answer for i in share]
    scored = reward.score(encoder.response_texts(rollout), answers)
    lengths = rollout.response_lengths.tolist()
    all_correct = _gather_dp(list(scored.correct), groups)
    all_rewards = _gather_dp(list(scored.rewards), groups)
    all_lengths = _gather_dp(lengths, groups)
    if estimator is not None:
        advantages = estimator.compute(all_correct, all_lengths)
    else:
        advantages = group_normalized_advantages(
            all_rewards, GroupAdvantageConfig(group_size=r.samples_per_prompt)
        )
    mine = advantages[share.start : share.stop]
    padded = _padded(rollout, cfg, eos_id)
    reference_logprobs = None
    if reference is not None:
        reference_logprobs = compute_token_logprobs(
            reference, padded.tokens, padded.labels, temperature=padded.logprob_temperature,
            vocab_size=sampler.vocab_size, groups=groups,
            micro_batch_size=cfg.train.micro_batch_size,
        ).cpu()
    mbs = cfg.train.micro_batch_size
    device = groups.device
    microbatches = []
    for lo in range(0, len(share), mbs):
        rows = slice(lo, lo + mbs)
        microbatches.append(_RLMicrobatch(
            tokens=padded.tokens[rows].to(device), labels=padded.labels[rows].to(device),
            position_ids=padded.position_ids[rows].to(device),
            response_mask=padded.response_mask[rows].to(device),
            rollout_logprobs=padded.rollout_logprobs[rows].to(device),
            reference_logprobs=(reference_logprobs[rows].to(device)
                                if reference_logprobs is not None else None),
            advantages=mine[rows].to(device), finished=padded.finished[rows].to(device),
        ))
    for chunk in setup.model_chunks:
        chunk.zero_grad_buffer()
    setup.optimizer.zero_grad()
    lr = float(setup.optimizer.param_groups[0]["lr"])
    forward_step = functools.partial(
        _rl_forward_step, cfg=cfg, vocab_size=sampler.vocab_size, tp_rank=groups.tp_rank,
        temperature=padded.logprob_temperature,
    )
    iterators = [iter(microbatches) for _ in setup.model_chunks]
    reports = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=setup.model_chunks, num_microbatches=len(microbatches),
        seq_length=cfg.model.seq_length, micro_batch_size=mbs, forward_only=False,
    )
    local = torch.zeros(7, dtype=torch.float64, device=device)
    for report in reports:
        local += report["rl"].to(device)
    loss_sum, tokens, ratio_sum, gap_sum, gap_tokens, all_gap_sum, all_gap_tokens = (
        _replica_sum(local, groups).tolist()
    )
    if control is not None:
        if gap_tokens > 0:
            control.observe_mismatch(gap_sum / gap_tokens)
        control.set_batch(_probe(padded, share, cfg, device))
        success, grad_norm, _ = setup.optimizer.step(control=control)
    else:
        success, grad_norm, _ = setup.optimizer.step()
    if not success:
        raise RuntimeError(f"optimizer step {step + 1} reported failure")
    setup.scheduler.step(1)
    kl_metrics = control.metrics(control.realised()) if control is not None else {}
    if groups.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    generated = sum(all_lengths)
    paper_logra = cfg.optimizer.name == "logra" and cfg.logra.mode == "paper"
    record = {
        "step": step + 1,
        "loss": loss_sum / max(tokens, 1.0),
        "reward": sum(all_rewards) / len(all_rewards),
        "accuracy": sum(all_correct) / len(all_correct),
        "response_length": generated / len(all_lengths),
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        # The paper's update has no learning rate (the update ratio and alpha size it).
        "lr": None if paper_logra else lr,
        ("importance_weight_mean" if r.loss == "paper" else "ratio_mean"):
            ratio_sum / max(tokens, 1.0),
        "rollout_trainer_gap": gap_sum / gap_tokens if gap_tokens else None,
        "logprob_gap_all_tokens": all_gap_sum / max(all_gap_tokens, 1.0),
        **kl_metrics,
        "tokens": generated,
        "step_time_s": elapsed,
        "tokens_per_s": generated / elapsed,
        "mem_bytes": (int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda"
                      else peak_rss_bytes()),
    }
    if estimator is not None:
        record["baseline"] = estimator.baseline
    return record


def _probe(padded: PaddedRollout, share: range, cfg: Config, device: torch.device) -> ProbeBatch:
    """The first ``probe_responses`` responses of the global batch held by this DP rank, at
    their generated positions, at most ``probe_max_tokens`` positions."""
    settings = cfg.kl_control
    rows = max(0, min(settings.probe_responses - share.start, len(share)))
    length = min(settings.probe_max_tokens, padded.tokens.shape[1])
    return ProbeBatch(
        tokens=padded.tokens[:rows, :length].to(device),
        position_ids=padded.position_ids[:rows, :length].to(device),
        mask=padded.response_mask[:rows, :length].to(device),
    )


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (2**62)


def _evaluate(
    *, cfg: Config, sampler: MegatronSampler, encoder: _Encoder, reward: Any,
    problems: list[PromptProblem], groups: ParallelGroups,
) -> tuple[dict[str, float], list[EvalAnswer]]:
    """Held-out pass@1 / pass@k (k = rl.eval_samples, unbiased estimator) and greedy accuracy,
    and the per-problem answers behind them (the same list on every rank)."""
    k, eos_id = cfg.rl.eval_samples, encoder.tokenizer.eos_id
    repeated = [problem for problem in problems for _ in range(k)]
    sampled, _ = _score(sampler.generate(encoder.prompt_ids(repeated),
                                         _sampling(cfg, eos_id, evaluation=True), seed=EVAL_SEED),
                        repeated, encoder, reward, groups)
    greedy, greedy_texts = _score(
        sampler.generate(encoder.prompt_ids(problems),
                         _sampling(cfg, eos_id, evaluation=True, greedy=True), seed=EVAL_SEED),
        problems, encoder, reward, groups,
    )
    per_problem = [sum(sampled[i * k : (i + 1) * k]) for i in range(len(problems))]
    metrics = {
        "eval_pass@1": mean_pass_at_k(k, per_problem, 1),
        "eval_pass@k": mean_pass_at_k(k, per_problem, k),
        "eval_k": k,
        "eval_greedy": sum(greedy) / len(greedy),
        "eval_problems": len(problems),
    }
    answers = [
        EvalAnswer(prompt=p.prompt, answer=p.answer, greedy=text, greedy_correct=bool(right),
                   samples_correct=int(n))
        for p, text, right, n in zip(problems, greedy_texts, greedy, per_problem, strict=True)
    ]
    return metrics, answers


def _score(rollout: RolloutBatch, problems: list[PromptProblem], encoder: _Encoder,
           reward: Any, groups: ParallelGroups) -> tuple[list[bool], list[str]]:
    """Correctness and response text of every problem, gathered over DP (global order)."""
    share = data_parallel_share(len(problems), groups.dp_rank, groups.dp_size)
    texts = encoder.response_texts(rollout)
    result = reward.score(texts, [problems[i].answer for i in share])
    gathered = _gather_dp(list(zip(result.correct, texts, strict=True)), groups)
    return [bool(right) for right, _ in gathered], [text for _, text in gathered]


