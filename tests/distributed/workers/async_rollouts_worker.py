"""The RL job generating one step ahead on a separate engine (``rollout.max_staleness=1``), its
resume with a batch in flight, and an engine killed mid-generation (run with torchrun, 2
processes: the trainer at DP=2, TP=1; the Megatron engine at TP=1 in a process of its own).

Paper-mode LoGRA with the KL step control, weights checked after every step
(``sync.check_interval=1``), the records' tensors broadcast to the engine
(``sync.transport=collective``), the engine pinned to the last core (``rollout.cpus``). Records
``engine_cores`` (the engine process's affinity) and:

* ``steps``: the records of ``--steps`` steps of job A, run as the training loop runs them (a
  checkpoint saved after step ``--checkpoint-at``, while the next batch is in flight), and
  ``estimated_in_flight``: what the memory estimate says one version in flight holds;
* ``versions``: for each step's batch, the per-token gap between the engine's log-probs and the
  trainer's recomputation with the weights of the batch's version, and of the version after it
  (snapshots of the trainer's weights after every step), and the mean of ``log pi_version -
  log pi_trained`` (the policy's own drift between the two) over the completed responses'
  tokens and over every generated token;
* ``resumed``: job B, a new job and engine resumed from that checkpoint, runs the remaining
  steps: its records, and whether its final weights equal job A's;
* ``dead_engine``: the error a step's wait raises after engine rank 0 was killed while it
  generated a large batch, and whether the batch was still unanswered at the kill.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist
from harness import Case, run_worker

from megatron_logra.config import load_config
from megatron_logra.mcore import (
    compute_token_logprobs,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from megatron_logra.mcore.models.sharding import global_named_parameters
from megatron_logra.mcore.models.sync_state import served_weights
from megatron_logra.memory.in_flight import in_flight_bytes
from megatron_logra.memory.shapes import shape_from_model_config
from megatron_logra.rl.losses import rollout_mismatch_sums
from megatron_logra.rl.rollout import SamplingParams
from megatron_logra.sync.checksum import weight_checksums
from megatron_logra.train.rl.batching import pad_to_length
from megatron_logra.train.rl.collectives import from_world_rank0
from megatron_logra.train.rl.job import RLJob
from tests.presets import SWIGLU_RMSNORM_NO_BIAS, tiny_gpt
from tests.torchrun import REPO

RL_CONFIG = REPO / "configs" / "demo_rl_cpu.yaml"
# The large generation the engine is killed in: long enough to be under way when the kill
# comes (the kill waits until the request was sent, then this long).
KILL_PROMPTS, KILL_TOKENS, KILL_AFTER_S = 512, 16, 0.2
ENGINE_CORE = max(os.sched_getaffinity(0))
NOT_COMPARED = ("mem_bytes", "tokens_per_s", "state_bytes", "host_state_bytes")


def cfg_for(args, world: int):
    overrides = [
        "parallel.tp=1", *tiny_gpt(), *SWIGLU_RMSNORM_NO_BIAS, "train.micro_batch_size=4",
        f"train.steps={args.steps}", "rl.prompts_per_step=8", "rl.sampling.max_new_tokens=5",
        "rl.eval.prompts=4", "rl.eval.samples=1", "rl.eval.interval=0",
        "logra.kl_control.probe_responses=4", "rollout.placement=separate", "rollout.tp=1",
        "rollout.max_staleness=1", "rollout.start_timeout_s=300", "sync.check_interval=1",
        # The records' tensor bytes broadcast from the thread that calls the engine (the vLLM
        # RL test runs one step off policy over the rpc transport).
        "sync.transport=collective",
        # The engine on a core of its own: the machine's last one.
        f"rollout.cpus=[{ENGINE_CORE}]",
        f"data.dir={args.data}", f"run.dir={args.out / 'run'}",
    ]
    return load_config(RL_CONFIG, overrides, command="rl").resolved(world, "rl")


def _weights(job: RLJob) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone()
            for chunk in job.setup.model_chunks for name, param in global_named_parameters(chunk)}


def _load(job: RLJob, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for chunk in job.setup.model_chunks:
            for name, param in global_named_parameters(chunk):
                param.copy_(weights[name])


def _computed(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.endswith("_s") and k not in NOT_COMPARED}


def _all_max(value: torch.Tensor) -> float:
    top = value.reshape(1).double()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return float(top[0])


def _all_mean(sums) -> float | None:
    totals = torch.stack([sums.gap_sum, sums.num_tokens.double()])
    dist.all_reduce(totals)
    return float(totals[0] / totals[1]) if totals[1] else None


def _version_check(job: RLJob, step: int, batch, snapshots: dict, groups) -> dict:
    """Step ``step``'s batch: the engine's log-probs against the trainer's at the batch's
    version and the next one; the drift between the batch's version and the trained one."""
    cfg = job.cfg
    padded = pad_to_length(batch.rollout, cfg.model.seq_length, job.encoder.pad_id)
    mask = padded.response_mask
    at = {}
    for version in {batch.version, batch.version + 1, step}:
        _load(job, snapshots[version])
        at[version] = compute_token_logprobs(
            job.setup.model_chunks, padded.tokens, padded.labels,
            temperature=padded.logprob_temperature, vocab_size=job.vocab_size, groups=groups,
            micro_batch_size=cfg.train.micro_batch_size).cpu()
    gap = {v: torch.where(mask, (padded.rollout_logprobs - lp).abs(), 0.0).max()
           for v, lp in at.items()}
    trained, generated = at[step], at[batch.version]
    every = torch.ones_like(padded.finished)
    return {
        "step": step + 1, "version": batch.version,
        "engine_vs_its_version": _all_max(gap[batch.version]),
        "engine_vs_next_version": _all_max(gap[batch.version + 1]),
        "engine_vs_trained_version": _all_max(gap[step]),
        "drift_completed": _all_mean(rollout_mismatch_sums(trained, generated, mask,
                                                           padded.finished)),
        "drift_all_tokens": _all_mean(rollout_mismatch_sums(trained, generated, mask, every)),
    }


def _record_takes(job: RLJob, taken: dict) -> None:
    take = job.pipeline.take

    def keep(step, *args, **kwargs):
        taken[step] = take(step, *args, **kwargs)
        return taken[step]
    job.pipeline.take = keep


def _kill_mid_generation(job: RLJob, version: int) -> dict:
    prompts = job.encoder.prompt_ids(job.schedule.step_problems(0))[:1] * KILL_PROMPTS
    params = SamplingParams(max_new_tokens=KILL_TOKENS, temperature=1.0,
                            stop_ids=job.encoder.stop_ids)
    job.pipeline.request(1000, prompts, params, seed=1, version=version)

    def kill() -> bool:
        ticket = job.pipeline._requests[1000].ticket
        while ticket.started is None:
            time.sleep(0.01)
        time.sleep(KILL_AFTER_S)
        answered = ticket.done.is_set()
        member = job.separate_engine._procs.members[0]
        member.process.kill()
        member.process.wait()
        return answered
    report = {"answered_before_kill": from_world_rank0(kill, "kill")}
    try:
        job.pipeline.take(1000, prompts, params, seed=1, version=version)
        report["error"] = "no error"
    except RuntimeError as error:
        report["error"] = str(error)
    return report


def measure(args, cfg, groups):
    report: dict = {}
    ckpt_dir = args.out / "ckpt"
    job = RLJob(cfg, groups)
    taken: dict = {}
    try:
        def affinity() -> list[int]:
            return sorted(os.sched_getaffinity(job.separate_engine._procs.members[0].process.pid))
        report["engine_cores"] = from_world_rank0(affinity, "engine affinity")
        report["pinned_core"] = ENGINE_CORE
        _record_takes(job, taken)
        job.initial_records(0)
        snapshots = {0: _weights(job)}
        records = []
        for step in range(args.steps):
            record = job.step(step)
            record.update(job.after_step(step + 1))
            records.append(record)
            snapshots[step + 1] = _weights(job)
            if step + 1 == args.checkpoint_at:
                report["in_flight_at_checkpoint"] = job.pipeline.in_flight()
                save_checkpoint(ckpt_dir, step=step + 1, setup=job.setup, cfg=cfg, groups=groups,
                                extra_common=job.checkpoint_state())
        final = weight_checksums(served_weights(job.setup.model_chunks, groups).items())
        report["steps"] = records
        report["estimated_in_flight"] = dataclasses.asdict(in_flight_bytes(
            shape_from_model_config(cfg.model, vocab_size=job.vocab_size), max_staleness=1,
            sequences=cfg.rl.global_batch, response_tokens=cfg.rl.sampling.max_new_tokens,
            sync_mode="low_rank", wire_dtype=cfg.sync.wire_dtype,
            params_dtype=cfg.model.params_dtype, targets=tuple(cfg.logra.targets),
            sketch_rank=cfg.logra.sketch_rank, dense_non_targets=False))
        report["versions"] = [_version_check(job, step, taken[step], snapshots, groups)
                              for step in sorted(taken)]
        _load(job, snapshots[args.steps])
    finally:
        job.close()

    resumed = RLJob(cfg, groups)
    try:
        common = load_checkpoint(latest_checkpoint(ckpt_dir), setup=resumed.setup, cfg=cfg,
                                 groups=groups, verify=True)
        resumed.load_checkpoint_state(common)
        resumed.initial_records(args.checkpoint_at)
        later = []
        for step in range(args.checkpoint_at, args.steps):
            record = resumed.step(step)
            record.update(resumed.after_step(step + 1))
            later.append(record)
        again = weight_checksums(served_weights(resumed.setup.model_chunks, groups).items())
        report["resumed"] = {
            "steps": later, "final_weights_equal": again == final,
            "computed_equal": [_computed(a) == _computed(b)
                               for a, b in zip(records[args.checkpoint_at:], later, strict=True)],
        }
        report["dead_engine"] = _kill_mid_generation(resumed, args.steps)
    finally:
        resumed.close()
    return report


def add_arguments(parser) -> None:
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--checkpoint-at", type=int, default=2)


if __name__ == "__main__":
    run_worker({"async_rollouts": Case(cfg_for, measure, world_sizes=(2,))}, add_arguments)
