"""Policy sync of a separate rollout engine: after every step's updates the engine's weights are
brought to the trainer's (docs/sync.md).

``sync.mode=low_rank`` (LoGRA): the optimizer's ``update_listener`` collects each update's
records on every rank; they are gathered over the trainer world and combined into one record
per layer and update (``combine_rank_records``), the trainable non-targets (library mode's
Adam) ship dense, every record as ``megatron_logra.sync.wire`` bytes. A full sync -- the exact
state in buckets of ``sync.bucket_bytes``: fp32 masters of the targets, the rest in its own
dtype -- happens before the first rollout of a process (the start and after a resume: the
engine's counts restart from the trainer's), every ``sync.full_interval`` updates, and whenever
the checksums of the served weights, compared every ``sync.check_interval`` updates, disagree.
``sync.mode=full`` ships the full state after every step (the baseline). ``sync.mode=delta``
(any optimizer) ships the XOR of the engine's state against the trainer's, compressed
(:mod:`megatron_logra.sync.delta`); world rank 0 keeps the state of the last sync to XOR
against. ``auto`` is low_rank for LoGRA -- unless the engine cannot replay merges on the
trainer's kind of device (:mod:`megatron_logra.sync.replay_device`), then delta -- and full for
the other optimizers.

What the engine holds, and so what a full sync and a delta carry: with low-rank records (the
engine keeps an fp32 shadow of the targets) the exact state, fp32 masters of the targets;
otherwise the served weights in their own dtype (no shadow on the engine).

Every method is collective over the trainer world; world rank 0 talks to the engine and an
error there is raised on every rank (``from_world_rank0``). Metrics per step: ``sync_bytes``
(the encoded bytes shipped), ``sync_time_s`` (gathers, encoding, transfer and the engine's
apply; rank 0's clock), ``sync_full_bytes`` (what one full sync ships), and on checked steps
``sync_weights_match``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_logra.config import Config
from megatron_logra.mcore import ParallelGroups
from megatron_logra.mcore.conversion import (
    HF_CONFIG_FILE,
    architecture_from_hf_config,
    hf_tensors_from_megatron,
)
from megatron_logra.mcore.models.sync_state import (
    exact_state,
    served_weights,
    target_param_names,
    trainable_non_targets,
)
from megatron_logra.rollout.engine import GenerationEngine
from megatron_logra.rollout.factory import vllm_checkpoint_dir
from megatron_logra.sync.checksum import mismatched_weights, weight_checksums
from megatron_logra.sync.delta import delta_buckets
from megatron_logra.sync.records import DenseUpdate, combine_rank_records, full_sync_buckets
from megatron_logra.sync.replay_device import low_rank_replay_problem
from megatron_logra.sync.wire import encode
from megatron_logra.train.rl.collectives import from_world_rank0

logger = logging.getLogger(__name__)


def engine_shadow_targets(cfg: Config, has_logra: bool) -> list[str]:
    """The LoGRA targets a separate engine keeps an exact fp32 shadow of: all of them where
    low-rank records ship (``sync.mode`` low_rank, or auto for LoGRA), none otherwise (full and
    delta sync hand the engine its served weights)."""
    if not has_logra or cfg.sync.resolved_mode(cfg.optimizer.name) != "low_rank":
        return []
    return target_param_names(cfg.logra.targets, cfg.model.num_layers)


class PolicySync:
    """Keeps the engine held by world rank 0 (None on the other ranks) equal to the trainer."""

    def __init__(self, cfg: Config, setup: Any, groups: ParallelGroups,
                 engine: GenerationEngine | None) -> None:
        self.cfg, self.setup, self.groups, self.engine = cfg, setup, groups, engine
        self.mode = cfg.sync.resolved_mode(cfg.optimizer.name)
        self.world = dist.group.WORLD
        self._records: list = []
        logra = setup.logra
        targets = frozenset() if logra is None else frozenset(
            f"{t.layer_key}.weight" for t in logra.targets)
        # The engine was started with a shadow of these (engine_shadow_targets).
        self.shadowed = bool(engine_shadow_targets(cfg, logra is not None))
        if self.mode == "low_rank":
            self.mode = self._low_rank_or_delta()
        if logra is not None:
            expected = frozenset(target_param_names(cfg.logra.targets, cfg.model.num_layers))
            mine = frozenset(targets)
            if not mine <= expected:
                raise RuntimeError(f"LoGRA targets {sorted(mine - expected)[:4]} are not the "
                                   "engine's target names")
            if self.mode == "low_rank":
                logra.update_listener = self._records.extend
        self.dense_names = trainable_non_targets(setup.model_chunks, targets)
        self.synced = False
        self.full_bytes = 0
        self._since_full = 0
        self._since_check = 0
        self._updates = 0  # updates this process has seen (a non-LoGRA run's count)
        self._resumed = 0  # updates before this process (a resumed non-LoGRA run)
        self._hf_arch = None  # a Hugging Face engine's layout, read on first use (rank 0)
        self._view: dict[str, torch.Tensor] = {}  # delta: what the engine holds (rank 0)
        self._view_counts: dict[str, int] = {}

    def _low_rank_or_delta(self) -> str:
        """low_rank if the engine replays merges exactly; else delta under ``auto`` and an error
        under ``low_rank`` (collective)."""
        merge_device = self.groups.device.type

        def problem() -> str | None:
            return low_rank_replay_problem(merge_device, self.engine.replay_device)
        reason = from_world_rank0(problem, "the engine's replay device")
        if reason is None:
            return "low_rank"
        if self.cfg.sync.mode == "auto":
            logger.warning("sync.mode=auto ships sparse deltas: %s", reason)
            return "delta"
        raise ValueError(f"sync.mode=low_rank: {reason}; use sync.mode=delta (exact on any "
                         "device) or sync.mode=auto")

    # ------------------------------------------------------------------ counts

    def update_count(self) -> int:
        logra = self.setup.logra
        return logra.update_count if logra is not None else self._resumed + self._updates

    # ------------------------------------------------------------------ the step's hooks

    def ensure_synced(self, resumed_updates: int = 0) -> dict[str, Any]:
        """A full sync unless the engine holds this process's weights already (collective)."""
        if self.synced:
            return {}
        self._resumed = resumed_updates
        start = time.perf_counter()
        sent = self._full_sync()
        return {"sync_bytes": sent, "sync_time_s": time.perf_counter() - start}

    def after_updates(self, updates: int) -> dict[str, Any]:
        """Ship what ``updates`` optimizer steps changed; the step's sync metrics."""
        start = time.perf_counter()
        self._updates += updates
        self._since_full += updates
        self._since_check += updates
        s = self.cfg.sync
        metrics: dict[str, Any] = {"sync_mode": self.mode}
        if self.mode == "full":
            self._records.clear()
            sent = self._full_sync()
        else:
            if self.mode == "delta":
                sent, metrics["sync_changed_fraction"] = self._ship_delta()
            else:
                sent = self._ship_updates()
            if s.full_interval and self._since_full >= s.full_interval:
                sent += self._full_sync()
        if s.check_interval and self._since_check >= s.check_interval:
            self._since_check = 0
            match = not self.mismatched()
            if not match:
                # The engine drifted (or missed a record): restore it from the exact state.
                sent += self._full_sync()
                still = self.mismatched()
                if still:
                    raise RuntimeError(f"the rollout engine's weights {still[:4]} differ from "
                                       "the trainer's even after a full sync")
            metrics["sync_weights_match"] = match
        elapsed = from_world_rank0(lambda: time.perf_counter() - start, "sync timing")
        return {"sync_bytes": sent, "sync_time_s": elapsed,
                "sync_full_bytes": self.full_bytes, **metrics}

    # ------------------------------------------------------------------ pieces

    def _send(self, payloads: list[bytes], what: str) -> int:
        def ship() -> int:
            for payload in payloads:
                self.engine.apply_sync(payload)
            return sum(len(p) for p in payloads)
        return from_world_rank0(ship, what)

    def _engine_state(self) -> dict[str, torch.Tensor]:
        """What the engine holds exactly (collective): with a target shadow the fp32 masters of
        the targets and the rest served, otherwise the served weights."""
        if self.shadowed:
            return exact_state(self.setup, self.groups, self.world)
        return served_weights(self.setup.model_chunks, self.groups)

    def _full_sync(self) -> int:
        state = self._engine_state()
        payloads: list[bytes] = []
        if self.groups.world_rank == 0:
            count = self.update_count()
            buckets = full_sync_buckets(state, update_count=count,
                                        bucket_bytes=self.cfg.sync.bucket_bytes)
            payloads = [encode(bucket, wire_dtype="fp32") for bucket in buckets]
            if self.mode == "delta":
                self._view, self._view_counts = state, dict.fromkeys(state, count)
        sent = self._send(payloads, "full policy sync")
        self.full_bytes = sent
        self.synced = True
        self._since_full = 0
        return sent

    def _ship_delta(self) -> tuple[int, float]:
        """The XOR of the engine's state against the trainer's, compressed; the bytes shipped
        and the fraction of elements that changed."""
        state = self._engine_state()
        payloads: list[bytes] = []
        fraction = 0.0
        if self.groups.world_rank == 0:
            count = self.update_count()
            buckets = delta_buckets(state, self._view, self._view_counts, update_count=count,
                                    bucket_bytes=self.cfg.sync.bucket_bytes)
            payloads = [encode(bucket, wire_dtype="fp32") for bucket in buckets]
            changed = sum(t.changed for b in buckets for t in b.tensors.values())
            fraction = changed / max(sum(t.numel() for t in state.values()), 1)
            self._view = state
            self._view_counts.update({n: count for b in buckets for n in b.tensors})
        sent = self._send(payloads, "delta policy sync")
        return sent, from_world_rank0(lambda: fraction, "delta sync fraction")

    def _ship_updates(self) -> int:
        per_rank: list[list | None] = [None] * dist.get_world_size(self.world)
        dist.all_gather_object(per_rank, list(self._records), group=self.world)
        self._records.clear()
        records = [r for rank in per_rank for r in (rank or [])]
        counts = sorted({r.update_count for r in records})
        dense = served_weights(self.setup.model_chunks, self.groups, names=self.dense_names)
        payloads: list[bytes] = []
        if self.groups.world_rank == 0:
            wire = self.cfg.sync.wire_dtype
            for count in counts:
                combined = combine_rank_records(
                    [[r for r in (rank or []) if r.update_count == count] for rank in per_rank])
                payloads += [encode(record, wire_dtype=wire) for record in combined]
            if counts:
                payloads += [encode(DenseUpdate(name, counts[-1], value), wire_dtype=wire)
                             for name, value in sorted(dense.items())]
        return self._send(payloads, "low-rank policy sync")

    def _engine_layout(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The trainer's full weights named and laid out as the engine reports its own."""
        if self.engine.weight_layout == "megatron":
            return weights
        if self.engine.weight_layout != "huggingface":
            raise RuntimeError(f"the rollout engine's weight_layout "
                               f"{self.engine.weight_layout!r} is not megatron or huggingface")
        if self._hf_arch is None:
            # The mapping of the checkpoint the engine loaded (written at RL start).
            config = json.loads((vllm_checkpoint_dir(self.cfg) / HF_CONFIG_FILE).read_text())
            self._hf_arch = architecture_from_hf_config(config)
        return hf_tensors_from_megatron(weights, self._hf_arch)

    def mismatched(self) -> list[str]:
        """Names whose served weights differ between the trainer and the engine (collective)."""
        weights = served_weights(self.setup.model_chunks, self.groups)

        def compare() -> list[str]:
            return mismatched_weights(weight_checksums(self._engine_layout(weights).items()),
                                      self.engine.weight_checksums())
        return from_world_rank0(compare, "policy sync weight check")
