"""RL post-training on Megatron (``megatron-logra rl``), one step in four phases:

1. **rollouts** (:mod:`.rollouts`): the step's global prompt list (``rl.prompts_per_step`` x
   ``rl.samples_per_prompt``); the rollout engine samples this data-parallel rank's share with
   the current weights; rewards of the share; correctness and lengths gathered over DP, and the
   preset's advantages computed on the whole global batch, identically on every rank. A
   separate engine's batches come from :mod:`.rollout_pipeline`: requested up to
   ``rollout.max_staleness`` steps ahead, so that with it > 0 the engine generates while the
   trainer updates, each tagged with the policy version that generated it (docs/async.md);
2. **batching** (:mod:`.update_batches`): the step's sequences packed into token-budget rows
   balanced over DP (train.packing, the default) or padded to model.seq_length
   (:mod:`.batching`), with the reference and old log-probs over the same microbatches; the KL
   probe set (evenly spaced responses of the global batch);
3. **policy update** (:mod:`.policy_update`): the preset's loss through Megatron's schedule, the
   rollout-vs-trainer gap on completed responses fed to the KL controller's mismatch term, one
   optimizer step (LoGRA predicts the KL of its update on the probe set and scales it), and the
   realised KL measured after it; ``rl.updates_per_rollout`` such updates on the same batch
   (the GRPO ratio then against the trainer's log-probs before the first);
4. **evaluation** (:mod:`.evaluation`): held-out pass@1 / pass@k and greedy accuracy before
   training, every ``rl.eval.interval`` steps and at the end; each evaluation's per-problem
   answers go to ``<run.dir>/eval/step_NNNNNN.jsonl``.

The run around the steps (resume, metrics, checkpoints with the advantage estimator's state,
plots) is :mod:`megatron_logra.train.loop`'s.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from megatron_logra.config import Config
from megatron_logra.data.problem_files import load_split
from megatron_logra.data.run_tokenizer import embedding_rows, load_prompt_builder
from megatron_logra.mcore import (
    MegatronSampler,
    ParallelGroups,
    build_model_chunks,
    load_model_weights,
    setup_training,
)
from megatron_logra.probe_batch import rollout_probe_batch
from megatron_logra.rl.eval_answers import eval_answers_path, write_eval_answers
from megatron_logra.rl.presets import build_preset
from megatron_logra.rl.prompt_schedule import PromptSchedule
from megatron_logra.rl.rewards import build_reward
from megatron_logra.rl.rollout import SamplingParams
from megatron_logra.rollout.engine_queue import EngineQueue, QueuedEngine
from megatron_logra.rollout.factory import make_engine, vllm_checkpoint_dir
from megatron_logra.train.loop import run
from megatron_logra.train.metrics import memory_bytes
from megatron_logra.train.rl.batching import pad_to_length
from megatron_logra.train.rl.engine_checkpoint import write_engine_checkpoint
from megatron_logra.train.rl.engine_rollouts import SeparateEngineRollouts
from megatron_logra.train.rl.engine_waits import EngineWaits
from megatron_logra.train.rl.evaluation import evaluate
from megatron_logra.train.rl.policy_sync import PolicySync, engine_shadow_targets
from megatron_logra.train.rl.policy_update import update_policy
from megatron_logra.train.rl.prompts import PromptEncoder
from megatron_logra.train.rl.rollout_log import (
    append_rollouts,
    keep_rollouts_up_to,
    rollout_records,
)
from megatron_logra.train.rl.rollout_pipeline import RolloutPipeline, async_step_metrics
from megatron_logra.train.rl.rollouts import collect_rollouts, sampling_params, step_seed
from megatron_logra.train.rl.update_batches import update_batches

logger = logging.getLogger(__name__)


def rl(cfg: Config) -> dict[str, Any]:
    """Run ``cfg.train.steps`` RL steps; returns the last metrics record."""
    return run(cfg, RLJob)


class RLJob:
    """The policy (and, for GRPO with a reference KL, a frozen copy of it), its optimizer, the
    rollout engine, the reward and the prompt schedule of an RL run."""

    def __init__(self, cfg: Config, groups: ParallelGroups) -> None:
        r = cfg.rl
        self.cfg, self.groups = cfg, groups
        builder = load_prompt_builder(cfg)
        tokenizer = builder.tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.encoder = PromptEncoder(builder)
        self.eval_problems = load_split(cfg.data, r.eval.split)[: r.eval.prompts]
        self.schedule = PromptSchedule(load_split(cfg.data, "train"),
                                       prompts_per_step=r.prompts_per_step,
                                       samples_per_prompt=r.samples_per_prompt, seed=r.seed)
        self.preset = build_preset(r)
        chunks = build_model_chunks(cfg, groups, vocab_size=embedding_rows(cfg, tokenizer))
        if cfg.model.init_checkpoint:
            load_model_weights(cfg.model.init_checkpoint, model_chunks=chunks, cfg=cfg,
                               groups=groups, verify=cfg.checkpoint.verify)
        self.reference = None
        if self.preset.needs_reference_model:
            # A frozen copy of the starting policy for the k3 reference KL.
            self.reference = build_model_chunks(cfg, groups,
                                                vocab_size=embedding_rows(cfg, tokenizer))
            for ref_chunk, chunk in zip(self.reference, chunks, strict=True):
                ref_chunk.load_state_dict(chunk.state_dict())
                ref_chunk.requires_grad_(False)
        self.setup = setup_training(cfg, chunks, groups, kl_vocab_size=tokenizer.vocab_size)
        self.separate_engine = None
        self.sync: PolicySync | None = None
        self.pipeline: RolloutPipeline | None = None
        if cfg.rollout.separate:
            if cfg.rollout.engine == "vllm":
                # vLLM loads a Hugging Face checkpoint: the policy, through our converter, with
                # the tokenizer's vocabulary (vLLM masks no padded rows itself).
                write_engine_checkpoint(cfg, self.setup, groups, vllm_checkpoint_dir(cfg),
                                        vocab_size=tokenizer.vocab_size,
                                        stop_ids=builder.stop_ids)
            target_names = engine_shadow_targets(cfg, self.setup.logra is not None)
            # World rank 0 owns the engine; every rank learns whether it started, waiting as
            # long as the start takes (bounded by rollout.start_timeout_s, not by the
            # collective timeout).
            waits = EngineWaits(cfg.parallel.collective_timeout_s)
            started: list = []

            def start() -> None:
                started.append(make_engine(cfg, target_names))
                started[0].start()
            waits.run(start, "starting the rollout engine")
            self.separate_engine = started[0] if started else None
            # Every call to the engine goes through one queue, in order (rank 0): on a thread
            # of its own when batches are generated ahead (rollout.max_staleness > 0). The
            # other ranks wait on rank 0's calls through `waits`, as long as the engine's own
            # timeouts allow.
            calls = queued = None
            if self.separate_engine is not None:
                calls = EngineQueue(self.separate_engine,
                                    background=cfg.rollout.max_staleness > 0,
                                    request_timeout_s=cfg.rollout.request_timeout_s)
                queued = QueuedEngine(calls)
            self.waits = waits
            self.engine = SeparateEngineRollouts(queued, groups, waits,
                                                 vocab_size=tokenizer.vocab_size)
            self.sync = PolicySync(cfg, self.setup, groups, queued, waits)
            self.pipeline = RolloutPipeline(calls, groups, waits, vocab_size=tokenizer.vocab_size,
                                            max_staleness=cfg.rollout.max_staleness)
        else:
            self.engine = MegatronSampler(self.setup.model_chunks, groups,
                                          vocab_size=tokenizer.vocab_size)
        self.reward = build_reward(r.reward)
        self._resumed_updates = 0
        self._in_flight: dict[str, Any] | None = None  # a checkpoint's batches, until restored

    # ------------------------------------------------------------------ the loop's hooks

    def initial_records(self, start_step: int) -> list[dict[str, Any]]:
        self._resumed_updates = start_step * self.cfg.rl.updates_per_rollout
        if self.groups.world_rank == 0:
            keep_rollouts_up_to(Path(self.cfg.run.dir), start_step)
        if self.pipeline is not None:
            self.pipeline.load_state_dict(
                self._in_flight, prompts_of=lambda s: self._step_batch(s)[0],
                params=sampling_params(self.cfg.rl, self.encoder.stop_ids),
                seed_of=lambda s: step_seed(self.cfg.rl.seed, s), start_step=start_step)
        elif self._in_flight and self._in_flight.get("batches"):
            logger.warning("the checkpoint holds %d rollout batch(es) of a separate engine in "
                           "flight; colocated rollouts generate them again",
                           len(self._in_flight["batches"]))
        self._sync_before_rollouts()
        return [{"step": 0, **self._evaluate(0)}] if start_step == 0 else []

    def after_step(self, completed: int) -> dict[str, Any]:
        interval = self.cfg.rl.eval.interval
        if completed == self.cfg.train.steps and self.pipeline is not None:
            # The last step's sync records were posted: their errors surface before the end.
            self.waits.run(lambda: self.pipeline.calls.drain(), "rollout engine sync")
        if completed == self.cfg.train.steps or (interval and completed % interval == 0):
            return self._evaluate(completed)
        return {}

    def checkpoint_state(self) -> dict[str, Any]:
        state = {"advantage": self.preset.advantages.state_dict()}
        if self.pipeline is not None:
            state["in_flight"] = self.pipeline.state_dict()
        return {"rl": state}

    def load_checkpoint_state(self, common: dict[str, Any]) -> None:
        self.preset.advantages.load_state_dict(common["rl"]["advantage"])
        self._in_flight = common["rl"].get("in_flight")

    def close(self) -> None:
        self.reward.close()
        if self.pipeline is not None and self.pipeline.calls is not None:
            self.pipeline.calls.close()  # stops its thread, closes the engine
        elif self.separate_engine is not None:
            self.separate_engine.close()

    def _sync_before_rollouts(self) -> dict[str, Any]:
        """The full sync a separate engine needs before this process's first rollout."""
        if self.sync is None:
            return {}
        return self.sync.ensure_synced(self._resumed_updates)

    # ------------------------------------------------------------------ one step

    def step(self, step: int) -> dict[str, Any]:
        cfg, groups, setup = self.cfg, self.groups, self.setup
        start = time.perf_counter()
        waited = self._engine_waited()
        first_sync = self._sync_before_rollouts()
        rollout_start = time.perf_counter()
        problems = self.schedule.step_problems(step)
        engine = self.engine
        if self.pipeline is not None:
            # The policy's version is the number of completed steps.
            engine = self.pipeline.for_step(step, version=step, last_step=cfg.train.steps - 1,
                                            batch_of=self._step_batch)
        scored = collect_rollouts(
            engine, self.encoder, self.reward, self.preset.advantages,
            problems, rl=cfg.rl, step=step, groups=groups,
        )
        rollout_done = time.perf_counter()
        if groups.world_rank == 0 and cfg.rl.logged_rollouts:
            append_rollouts(Path(cfg.run.dir), rollout_records(
                step + 1, problems, scored, self.encoder.builder, cfg.rl.logged_rollouts))
        batches = update_batches(cfg, scored, pad_id=self.encoder.pad_id, groups=groups,
                                 policy=setup.model_chunks, reference=self.reference,
                                 vocab_size=self.vocab_size)
        probe = None
        if setup.kl_control is not None:
            padded = pad_to_length(scored.rollout, cfg.model.seq_length, self.encoder.pad_id)
            probe = rollout_probe_batch(padded, scored.share, cfg.logra.kl_control,
                                        groups.device, global_size=len(scored.rewards))
        step_metrics = setup.step_metrics()
        updates = [
            update_policy(
                setup, batches.microbatches, self.preset.loss, probe=probe,
                seq_length=batches.seq_length, micro_batch_size=batches.micro_batch_size,
                vocab_size=self.vocab_size, temperature=batches.temperature,
                groups=groups, observe_mismatch=index == 0,
            )
            for index in range(cfg.rl.updates_per_rollout)
        ]
        # The rollout/trainer gap is the first update's (before the policy moved); loss, ratio
        # and grad norm the last update's; the clipped fraction over every update.
        first, update = updates[0], updates[-1]
        clipped = sum(u.sums.clipped_tokens for u in updates)
        clip_tokens = sum(u.sums.tokens for u in updates)
        update_done = time.perf_counter()
        sync_metrics = {}
        if self.sync is not None:
            sync_metrics = self.sync.after_updates(len(updates))
            for key in ("sync_bytes", "sync_time_s"):
                sync_metrics[key] += first_sync.get(key, 0)
        control = setup.kl_control
        kl_metrics = control.metrics(control.realised()) if control is not None else {}
        if groups.device.type == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        elapsed = end - start
        sums = update.sums
        generated = sum(scored.lengths)
        overlap = {}
        if self.pipeline is not None:
            overlap = async_step_metrics(engine.taken, self.pipeline.calls, start=start, end=end,
                                         waited_before=waited)
        correction = {}
        if self.preset.loss.corrects:
            tokens = max(first.sums.tokens, 1.0)
            correction = {"importance_weight_mean": first.sums.weight_sum / tokens,
                          "importance_ratio_mean": first.sums.raw_ratio_sum / tokens,
                          "importance_ratio_max": first.ratio_max,
                          "importance_truncated_fraction": first.sums.truncated_tokens / tokens}
        return {
            "step": step + 1,
            "loss": sums.loss_sum / max(sums.tokens, 1.0),
            "reward": sum(scored.rewards) / len(scored.rewards),
            "accuracy": sum(scored.correct) / len(scored.correct),
            "reward_failed": scored.failed_grading,
            "response_length": generated / len(scored.lengths),
            # Responses cut at rl.sampling.max_new_tokens without a stop token.
            "truncated_fraction": scored.truncated / len(scored.lengths),
            "grad_norm": update.grad_norm,
            **step_metrics,
            self.preset.loss.ratio_metric: sums.ratio_sum / max(sums.tokens, 1.0),
            **({"clip_fraction": clipped / max(clip_tokens, 1.0)}
               if self.preset.loss.clips else {}),
            **correction,
            "rollout_trainer_gap": first.mismatch,
            "logprob_gap_all_tokens": sums.all_gap_sum / max(sums.all_gap_tokens, 1.0),
            "logprob_gap_max": first.gap_max,
            **({"reference_kl": sums.reference_kl_sum / max(sums.tokens, 1.0)}
               if self.reference is not None else {}),
            **kl_metrics,
            **(setup.logra.update_metrics() if setup.logra is not None else {}),
            "tokens": generated,
            **batches.metrics(),
            "step_time_s": elapsed,
            # The phases' own times: the rollouts with their rewards; the batching, log-probs
            # and updates; a separate engine's sync is sync_time_s.
            "rollout_time_s": rollout_done - rollout_start,
            "update_time_s": update_done - rollout_done,
            "tokens_per_s": generated / elapsed,
            "mem_bytes": memory_bytes(groups.device),
            **self.preset.advantages.metrics(),
            **sync_metrics,
            **overlap,
        }

    def _step_batch(self, step: int) -> tuple[list[list[int]], SamplingParams, int]:
        """Step ``step``'s prompt ids, sampling and seed, as collect_rollouts asks for them."""
        return (self.encoder.prompt_ids(self.schedule.step_problems(step)),
                sampling_params(self.cfg.rl, self.encoder.stop_ids),
                step_seed(self.cfg.rl.seed, step))

    def _engine_waited(self) -> float:
        calls = self.pipeline.calls if self.pipeline is not None else None
        return calls.waited_s if calls is not None else 0.0

    def _evaluate(self, step: int) -> dict[str, float]:
        metrics, answers = evaluate(self.engine, self.encoder, self.reward, self.eval_problems,
                                    rl=self.cfg.rl, groups=self.groups)
        if self.groups.world_rank == 0:
            write_eval_answers(answers, eval_answers_path(Path(self.cfg.run.dir), step))
        return metrics
