"""The RL job with its rollout engine in separate processes, kept in step by low-rank sync (run
with torchrun, 2 processes: the trainer at TP=``--trainer-tp``, data parallel over the rest).

Builds the real RL job (tiny GPT, library-mode LoGRA with weight decay, so Adam-trained
non-targets ship dense) with ``rollout.placement=separate`` and the Megatron engine at
``--engine-tp``, and records:

* ``first_rollout``: after the start's full sync, the separate engine's rollout of step 0's
  prompts against the colocated sampler's (``MegatronSampler`` on the trainer's own chunks,
  same seed): tokens and log-probs, on every rank's share;
* ``steps``: the sync metrics and phase times of ``--steps`` real RL steps (a checksum
  comparison every update); then the weight check, and whether the targets moved at all;
* ``after_steps_rollout``: the two rollouts again, on the trained weights;
* ``refusals``: the engine's answers to the last low-rank record sent again (repeated) and
  to that record two updates ahead (a gap), and the weight check after them;
* ``forced_mismatch``: one ulp changed in one element of a trainer target weight outside the
  optimizer, one more step: its metrics (the check must fail and the full sync restore
  equality) and the weight check after it;
* ``dead_engine``: the error a generate raises after engine rank 0 was killed;
* ``wire``: the records and bytes sent until the weight check after the steps, and what the
  collective transport (``--transport collective``) carried of them: headers over the control
  channel, tensor bytes over the broadcast.
"""

from __future__ import annotations

import dataclasses

import torch
from harness import Case, run_worker

from megatron_logra.config import load_config
from megatron_logra.mcore import MegatronSampler
from megatron_logra.mcore.models.sharding import global_named_parameters
from megatron_logra.mcore.models.sync_state import served_weights
from megatron_logra.sync.checksum import weight_checksums
from megatron_logra.sync.records import LowRankUpdate
from megatron_logra.sync.wire import decode, encode
from megatron_logra.train.rl.collectives import from_world_rank0
from megatron_logra.train.rl.job import RLJob
from megatron_logra.train.rl.rollouts import sampling_params, step_seed
from tests.presets import SWIGLU_RMSNORM_NO_BIAS, tiny_gpt
from tests.torchrun import REPO

RL_CONFIG = REPO / "configs" / "demo_rl_cpu.yaml"
# One element of a row-parallel target (TP rank 0's column slice; every DP replica alike) is
# nudged by one ulp.
PERTURBED = "decoder.layers.0.mlp.linear_fc2.weight"
TIMES = ("step_time_s", "rollout_time_s", "update_time_s")


def cfg_for(args, world: int):
    overrides = [
        f"parallel.tp={args.trainer_tp}", *tiny_gpt(), *SWIGLU_RMSNORM_NO_BIAS, "train.micro_batch_size=4",
        f"train.steps={args.steps + 1}", "rl.prompts_per_step=4", "rl.samples_per_prompt=2",
        "rl.sampling.max_new_tokens=4", "rl.eval.prompts=2", "rl.eval.interval=0",
        "logra.mode=library", "optimizer.lr=3e-3", "optimizer.weight_decay=0.1",
        "rollout.placement=separate", f"rollout.tp={args.engine_tp}",
        "rollout.start_timeout_s=120", "sync.check_interval=1", "sync.bucket_bytes=65536",
        f"sync.transport={args.transport}",
        f"data.dir={args.data}", f"run.dir={args.out / 'run'}",
    ]
    return load_config(RL_CONFIG, overrides, command="rl").resolved(world, "rl")


def _rollouts(job: RLJob, groups, step: int) -> dict:
    """Step ``step``'s prompts sampled by the separate engine and by the colocated sampler."""
    cfg = job.cfg
    prompts = job.encoder.prompt_ids(job.schedule.step_problems(step))
    params = sampling_params(cfg.rl, job.encoder.eos_id)
    seed = step_seed(cfg.rl.seed, step)
    colocated = MegatronSampler(job.setup.model_chunks, groups, vocab_size=job.vocab_size)
    ours = job.engine.generate(prompts, params, seed=seed)
    theirs = colocated.generate(prompts, params, seed=seed)
    return {
        "sequences": len(ours),
        "tokens_equal": torch.equal(ours.response_tokens, theirs.response_tokens),
        "lengths_equal": torch.equal(ours.response_lengths, theirs.response_lengths),
        "logprobs_equal": torch.equal(ours.logprobs, theirs.logprobs),
        "finished_equal": torch.equal(ours.finished, theirs.finished),
        "max_logprob_diff": float((ours.logprobs - theirs.logprobs).abs().max()),
    }


def measure(args, cfg, groups):
    job = RLJob(cfg, groups)
    report: dict = {}
    try:
        engine = job.separate_engine
        sent: list[bytes] = []
        if engine is not None:  # world rank 0: keep what goes on the wire (the real engine
            apply = engine.apply_sync  # still applies every record)

            def keep(payload: bytes) -> None:
                sent.append(payload)
                apply(payload)
            engine.apply_sync = keep
        job.sync.ensure_synced()
        report["first_rollout"] = _rollouts(job, groups, 0)
        initial = weight_checksums(served_weights(job.setup.model_chunks, groups).items())
        report["steps"] = [
            {k: v for k, v in job.step(step).items() if k.startswith("sync") or k in TIMES}
            for step in range(args.steps)
        ]
        final = served_weights(job.setup.model_chunks, groups)
        report["changed"] = sorted(n for n, d in weight_checksums(final.items()).items()
                                   if initial[n] != d)
        report["targets"] = sorted(f"{t.layer_key}.weight" for t in job.setup.logra.targets)
        report["mismatches_after_steps"] = job.sync.mismatched()

        def wire() -> dict:
            stats = engine.transport_stats
            return {"records": len(sent), "bytes": sum(len(p) for p in sent),
                    "transport": None if stats is None else dataclasses.asdict(stats)}
        report["wire"] = from_world_rank0(wire, "wire bytes")
        report["after_steps_rollout"] = _rollouts(job, groups, args.steps)

        def refuse() -> dict:
            last = next(p for p in reversed(sent) if isinstance(decode(p), LowRankUpdate))
            record = decode(last)
            answers = {}
            for name, payload in (
                ("repeated", last),
                ("gap", encode(dataclasses.replace(record, update_count=record.update_count + 2),
                               wire_dtype="fp32")),
            ):
                try:
                    apply(payload)
                    answers[name] = None
                except Exception as error:  # noqa: BLE001 -- the message is the measurement
                    answers[name] = str(error)
            return answers
        report["refusals"] = from_world_rank0(refuse, "refusals")
        report["mismatches_after_refusals"] = job.sync.mismatched()

        with torch.no_grad():
            for chunk in job.setup.model_chunks:
                for name, param in global_named_parameters(chunk):
                    if name == PERTURBED and groups.tp_rank == 0:
                        flat = param.data.view(-1)
                        flat[:1] = torch.nextafter(flat[:1], torch.full_like(flat[:1], 1e9))
        report["forced_mismatch"] = {
            k: v for k, v in job.step(args.steps).items() if k.startswith("sync")}
        report["mismatches_after_forced"] = job.sync.mismatched()

        def kill_and_generate() -> str:
            engine._procs.members[0].process.kill()
            engine._procs.members[0].process.wait()
            try:
                engine.generate([[1, 2]], max_new_tokens=2, temperature=1.0, top_p=1.0, seed=0)
            except Exception as error:  # noqa: BLE001 -- the message is the measurement
                return str(error)
            return "no error"
        report["dead_engine"] = from_world_rank0(kill_and_generate, "dead engine")
    finally:
        job.close()
    return report


def add_arguments(parser) -> None:
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--trainer-tp", type=int, default=2)
    parser.add_argument("--engine-tp", type=int, default=1)
    parser.add_argument("--transport", default="rpc")


# sync.mode=delta: one engine per optimizer and served dtype, in one process (the Megatron import
# and the torchrun start are paid once). fp32 served weights change nearly every bit pattern in
# a step (the delta is dense), bf16 ones a few percent.
DELTA_CASES: tuple[tuple[str, str, list[str]], ...] = (
    ("adam", "fp32", ["optimizer.lr=1e-4"]),
    ("lora", "bf16", ["optimizer.lr=1e-3", "lora.lora_rank=4"]),
    ("logra", "bf16", ["logra.mode=paper", "logra.update_ratio=1e-3"]),
)


def delta_cfg(args, world: int, optimizer: str = "adam", dtype: str = "fp32",
              extra: tuple[str, ...] = ()):
    overrides = [
        f"parallel.tp={args.trainer_tp}", *tiny_gpt(), *SWIGLU_RMSNORM_NO_BIAS,
        "train.micro_batch_size=4", f"train.steps={args.steps}", "rl.prompts_per_step=4",
        "rl.samples_per_prompt=2", "rl.sampling.max_new_tokens=4", "rl.eval.prompts=2",
        "rl.eval.interval=0", f"optimizer.name={optimizer}", f"model.params_dtype={dtype}",
        "logra.kl_control.enabled=false", *extra,
        "rollout.placement=separate", f"rollout.tp={args.engine_tp}",
        "rollout.start_timeout_s=120", "sync.mode=delta", "sync.check_interval=1",
        "sync.bucket_bytes=65536", f"sync.transport={args.transport}",
        f"data.dir={args.data}", f"run.dir={args.out / f'run_{optimizer}_{dtype}'}",
    ]
    return load_config(RL_CONFIG, overrides, command="rl").resolved(world, "rl")


def _delta_case(args, groups, optimizer: str, dtype: str, extra: tuple[str, ...]) -> dict:
    from megatron_logra.sync.delta import DeltaBucket

    job = RLJob(delta_cfg(args, groups.world_size, optimizer, dtype, extra), groups)
    case: dict = {}
    try:
        sent: list[bytes] = []
        engine = job.separate_engine
        apply = None
        if engine is not None:  # world rank 0: keep what goes on the wire
            apply = engine.apply_sync

            def keep(payload: bytes) -> None:
                sent.append(payload)
                apply(payload)
            engine.apply_sync = keep
        job.sync.ensure_synced()
        initial = weight_checksums(served_weights(job.setup.model_chunks, groups).items())
        case["steps"] = [{k: v for k, v in job.step(step).items() if k.startswith("sync")}
                         for step in range(args.steps)]
        final = served_weights(job.setup.model_chunks, groups)
        case["changed"] = sorted(n for n, d in weight_checksums(final.items()).items()
                                 if initial[n] != d)
        case["mismatches_after_steps"] = job.sync.mismatched()

        def refuse() -> dict:
            last = next(p for p in reversed(sent) if isinstance(decode(p), DeltaBucket))
            try:
                apply(last)
                return {"repeated": None}
            except Exception as error:  # noqa: BLE001 -- the message is the measurement
                return {"repeated": str(error)}
        case["refusals"] = from_world_rank0(refuse, "delta refusals")
        case["mismatches_after_refusals"] = job.sync.mismatched()
    finally:
        job.close()
    return case


def measure_delta(args, _cfg, groups):
    return {f"{optimizer}_{dtype}": _delta_case(args, groups, optimizer, dtype, tuple(extra))
            for optimizer, dtype, extra in DELTA_CASES}


if __name__ == "__main__":
    run_worker({"separate_engine": Case(cfg_for, measure, world_sizes=(2,)),
                "delta": Case(delta_cfg, measure_delta, world_sizes=(2,))}, add_arguments)
