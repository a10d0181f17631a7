"""LoGRA as a Megatron optimizer, chained with Megatron's own optimizer for everything else.

:class:`LoGRAOptimizer` owns the target weights of one rank: their flat fp32 sketch buffer, the
projections, the direction rule's state (RowAdam row moments) and the update count. It follows
Megatron's ``MegatronOptimizer`` contract (``prepare_grads`` / ``step_with_ready_grads`` /
``zero_grad`` / ``param_groups`` for the LR scheduler / ``state_dict``), so it chains with the
DDP-backed Adam or SGD that trains the embeddings, norms, biases and output layer
(:mod:`megatron_logra.mcore.optimizer.chained`).

Step anatomy (driven by Megatron's schedule and the training loop):

1. ``zero_grad``: the flat sketch buffer is zeroed with the DDP grad buffers.
2. forward/backward over the microbatches: sketched layers accumulate ``H^T P``.
3. ``finalize_model_grads`` (installed by :mod:`megatron_logra.mcore.training.setup`): after
   Megatron's own DP reduction, :meth:`LoGRAOptimizer.reduce_sketches` sums the buffer over DP
   (and row-parallel partials over TP) and applies the same scaling Megatron applied to the
   dense gradients (1/num_tokens, or 1/dp).
4. ``step``: global norm -> clip -> direction (in place) -> scale (the step scale's, e.g. the
   predicted-KL controller's) -> ``W <- (1 - lr wd) W - lr D A`` -> ``update_count += 1`` ->
   fresh projections.

Nothing non-finite reaches a weight: the sketch (``prepare_grads``), the direction, the paper's
update-ratio factor, the step scale alpha and every merged factor ``U`` are checked before
anything is applied, each check agreed on every rank (:mod:`megatron_logra.finite_check`). A
refused step raises ``RuntimeError`` with the stage named, after restoring the row moments the
direction rule had already advanced: no weight and no optimizer state was changed.

Its size (~600 lines) is the contract's: Megatron's optimizer interface, the step and its
checks, the update listener for policy sync and the reshardable state are one object's; the
arithmetic lives in the pure modules it calls (direction, projection, sketch, master weights).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer.optimizer import MegatronOptimizer

from megatron_logra.config import LoGRAConfig
from megatron_logra.direction import DirectionContext, DirectionRule, make_direction_rule
from megatron_logra.finite_check import agreed_flags, local_finite
from megatron_logra.logra_mode import LoGRAMode
from megatron_logra.master_weights import RowMaster, master_weights_mode
from megatron_logra.mcore.models.targets import SketchTarget
from megatron_logra.mcore.optimizer.expert_state import (
    expert_row_groups,
    hold_idle_experts_,
    idle_experts,
    model_has_experts,
    model_sum,
    row_moments_of,
)
from megatron_logra.mcore.optimizer.logra_state import (
    global_row_ranges,
    load_sharded_state,
    sharded_state_dict,
)
from megatron_logra.mcore.process_groups import ParallelGroups
from megatron_logra.mcore.tensor_parallel.sketched_linear import LayerSketch
from megatron_logra.norm_blocks import norm_block_rows
from megatron_logra.projection import generate_projection, projection_key
from megatron_logra.row_adam_paper import blockwise_sq_norm
from megatron_logra.sketch import apply_low_rank_update_, reconstructed_sq_norm
from megatron_logra.sketch_buffer import FlatSketchBuffer, SketchSlot
from megatron_logra.step_scale import ProposedUpdate, StepScale
from megatron_logra.sync.records import FactorPiece, LowRankUpdate, host_factor


class _TargetParamGroups(torch.optim.Optimizer):
    """Holds the target weights in one param group so Megatron's LR scheduler drives their lr
    and weight decay like any other group. It never steps: LoGRA updates the weights itself."""

    def __init__(self, weights: Sequence[torch.nn.Parameter], *, lr: float, weight_decay: float):
        super().__init__(
            [{"params": list(weights), "wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False}],
            {"lr": lr, "weight_decay": weight_decay},
        )

    def step(self, closure: Any = None) -> None:
        raise RuntimeError("LoGRA target weights are updated by LoGRAOptimizer, not stepped")


class LoGRAOptimizer(MegatronOptimizer):
    """Sketch-based updates of this rank's target weights.

    Precision modes for the target weights (``logra.master_weights``, a strategy of
    :mod:`megatron_logra.master_weights` chosen once):

    * ``none``: fp32 parameters are their own masters; every data-parallel rank holds and
      updates all rows (the sketch buffer is all-reduced).
    * ``dp_sharded`` / ``remainder`` / ``host``: bf16 parameters with exact masters sharded over
      the data-parallel group by whole rows (fp32 rows on the device, int16 remainders on the
      device, fp32 rows in host memory); a routed expert's over its expert-data-parallel group
      (the ranks that hold the same experts). The sketch buffer is reduce-scattered, each rank
      applies RowAdam and the update to the rows it owns, and the updated bf16 rows are
      all-gathered. The three give bit-identical weights.

    Behaviour is chosen at construction and fixed for the run: the ``mode`` (library or paper:
    how directions are sized and merged) and an optional ``step_scale`` that sizes every
    prepared update before it is applied (the predicted-KL step control); its state is saved
    in this optimizer's checkpoint.

    Args:
        targets: the sketched linears on this rank (their weights must be frozen to autograd).
        logra: the run's LoGRA section.
        mode: the strategy object of ``logra.mode`` (``megatron_logra.logra_mode``).
        config: the Megatron optimizer config shared with the chained native optimizer (lr,
            weight decay and clip_grad come from it and from the scheduler).
        groups: process groups of this rank.
        step_scale: chooses the scale of each prepared update (None: scale 1).
        update_listener: receives, after every applied update, one record per target of what
            this rank merged (its factor rows, the merge's scalars, the projection's seed): the
            trainer side of low-rank policy sync (:mod:`megatron_logra.sync`). None: no records.
    """

    def __init__(
        self,
        targets: Sequence[SketchTarget],
        *,
        logra: LoGRAConfig,
        mode: LoGRAMode,
        config: MegatronOptimizerConfig,
        groups: ParallelGroups,
        step_scale: StepScale | None = None,
        update_listener: Callable[[list[LowRankUpdate]], None] | None = None,
    ) -> None:
        if not targets:
            raise ValueError("LoGRAOptimizer needs at least one target on this rank")
        weight_dtype = targets[0].weight.dtype
        for target in targets:
            if target.weight.requires_grad:
                raise RuntimeError(
                    f"{target.layer_key}.weight still requires grad; freeze sketched weights "
                    "before building DDP so they stay out of its grad buffer"
                )
            if target.weight.dtype != weight_dtype:
                raise RuntimeError(
                    f"{target.layer_key}.weight is {target.weight.dtype}, other targets "
                    f"{weight_dtype}: targets must share one dtype"
                )
        self.master_weights = master_weights_mode(
            logra.master_weights, weight_dtype, merge_chunk_mib=logra.merge_chunk_mib
        )
        holder = _TargetParamGroups(
            [t.weight for t in targets], lr=config.lr, weight_decay=config.weight_decay
        )
        super().__init__(holder, config, init_state_fn=lambda *args: None)
        self.is_stub_optimizer = False
        self.targets = list(targets)
        self.logra = logra
        self.mode = mode
        self.step_scale = step_scale
        self.update_listener = update_listener
        self.groups = groups
        self.update_count = 0
        self.compute_dtype = weight_dtype
        sharded = self.master_weights.shards_rows
        self.sketches = FlatSketchBuffer(
            [
                SketchSlot(
                    t.layer_key, t.rows, self.sketch_rank_of(t), t.tp_partial, stride=t.stride,
                    expert=t.expert,
                )
                for t in self.targets
            ],
            device=targets[0].weight.device,
            dp_size=groups.dp_size if sharded else 1,
            dp_rank=groups.dp_rank if sharded else 0,
            # Experts' masters are sharded over the ranks that hold the same experts.
            expert_dp_size=groups.expert_dp_size if sharded else 1,
            expert_dp_rank=groups.expert_dp_rank if sharded else 0,
        )
        self.masters: dict[str, RowMaster] = {}
        for target in self.targets:
            master = self.master_weights.make(
                target.weight, self.sketches.shards[target.layer_key]
            )
            if master is not None:
                self.masters[target.layer_key] = master
        # Sketch statistics: replicated sketches are summed over model parallelism only; sharded
        # ones hold distinct rows on every DP rank as well (experts': on every expert-DP rank, so
        # every rank of the world holds a distinct share).
        self.stats_group = None if sharded else groups.mp
        self.expert_stats_group = None if sharded else groups.expert_mp
        self.model_has_experts = model_has_experts(self.targets, targets[0].weight.device)
        self.direction: DirectionRule = make_direction_rule(
            mode.direction(logra.direction), self.sketches, beta2=logra.beta2, eps=logra.eps
        )
        # Groups holding a layer's rows (for per-layer row statistics of the paper's RowAdam):
        # column-parallel rows are split over TP (and DP when sharded), row-parallel rows over
        # DP only when sharded.
        self.row_groups = {
            False: (groups.tp_dp if sharded else groups.tp) if groups.tp_size > 1 or sharded
            else None,
            True: groups.dp if sharded else None,
        }
        self.expert_row_groups = expert_row_groups(groups, sharded=sharded)
        self._prepared = False
        self._idle: list[str] = []
        """Expert targets that received no token in the prepared update."""
        self._state_before: dict[str, torch.Tensor] | None = None
        self._checked: tuple[float, list[tuple[torch.Tensor, float]]] | None = None
        self.last_update_scale: float | None = None
        self.last_merge_time_s: float | None = None
        """Wall time of the last update's merge (masters, weights and their all-gathers)."""
        for target in self.targets:
            target.module.logra_sketch = LayerSketch(
                target.layer_key, self._projection(target), self.sketches
            )

    # ------------------------------------------------------------------ projections

    def sketch_rank_of(self, target: SketchTarget) -> int:
        if self.logra.distribution == "identity":
            return target.in_features
        return self.logra.sketch_rank

    def _projection(self, target: SketchTarget) -> torch.Tensor:
        """A for the current update, held once in the compute (weight) dtype.

        It is drawn in fp32 and rounded to the compute dtype (bf16 with bf16 weights), the
        rounding the rollout engine reproduces from ``projection_dtype``; the forward pass
        projects bf16 activations with this tensor and the fp32 update casts it back per
        layer, exactly. Rademacher entries with a power-of-4 sketch rank are exact in bf16
        anyway; other ranks and Gaussian entries are rounded, identically for both uses.
        """
        count = self.update_count if self.logra.refresh else 0
        key = projection_key(self.logra.seed, count, target.layer_key)
        projection = generate_projection(
            key,
            self.sketch_rank_of(target),
            target.col_start,
            target.col_end,
            self.logra.distribution,
            dtype=torch.float32,
            device=target.weight.device,
        )
        return projection.to(self.compute_dtype)

    def refresh_projections(self) -> None:
        """Regenerate every projection for the current ``update_count``."""
        for target in self.targets:
            target.module.logra_sketch.projection = self._projection(target)

    def projection_of(self, target: SketchTarget) -> torch.Tensor:
        """The target's A as held: ``[r, n_local]`` in the compute dtype (cast it to fp32
        where fp32 arithmetic needs it, one layer at a time)."""
        return target.module.logra_sketch.projection

    # ------------------------------------------------------------------ gradients

    def reduce_sketches(self, num_tokens: torch.Tensor | None) -> None:
        """Sum sketches over DP (row-parallel partials also over TP); scale like Megatron.

        ``num_tokens`` is the global token count after Megatron's finalize_model_grads (per-token
        loss), or None, in which case Megatron averaged gradients over data parallelism.
        """
        self.sketches.reduce_(
            dp_group=self.groups.dp,
            tp_group=self.groups.tp,
            tp_dp_group=self.groups.tp_dp,
            tp_size=self.groups.tp_size,
            expert_dp_group=self.groups.expert_dp,
        )
        if num_tokens is not None:
            scale = 1.0 / num_tokens.item() if num_tokens.item() > 0 else 1.0
        else:
            scale = 1.0 / self.groups.dp_size
        if scale != 1.0:
            for segment in self.sketches.owned_segments():
                segment.mul_(scale)

    @torch.no_grad()
    def sketch_sq_norm(self) -> float:
        """``sum_l ||S_l A_l||^2`` over all targets of the model (every rank's share counted).

        Column-parallel ranks hold distinct rows of ``S A``, row-parallel ranks distinct column
        blocks (their full sketch rows times their slice of A), pipeline stages distinct layers,
        and with sharded masters DP ranks distinct rows: the sum over the statistics group counts
        every entry once. Replicated DP copies are identical and not summed.
        """
        return self._model_sum(lambda target: reconstructed_sq_norm(
            self.sketches.owned_view(target.layer_key), self.projection_of(target)))

    def _model_sum(self, per_target: Callable[[SketchTarget], Any]) -> float:
        """A model-wide sum of per-target shares (experts' over their own groups)."""
        return model_sum(self.targets, per_target, stats_group=self.stats_group,
                         expert_group=self.expert_stats_group, device=self.sketches.data.device,
                         model_has_experts=self.model_has_experts)

    @torch.no_grad()
    def clip_sketches_(self, max_norm: float, total_norm: float) -> None:
        """Megatron's clip rule (``max_norm / (total_norm + 1e-6)`` when below one)."""
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            for segment in self.sketches.owned_segments():
                segment.mul_(clip_coeff)

    # ------------------------------------------------------------------ MegatronOptimizer API

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none
        self.sketches.zero_()

    def get_loss_scale(self) -> torch.Tensor:
        return torch.ones(1, dtype=torch.float32, device=self.sketches.data.device)

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Refuse a non-finite sketch: it would poison the row moments for every later step."""
        if not self._all_ranks_finite({"sketch": local_finite(self.sketches.owned_segments())}):
            bad = [
                slot.layer_key
                for slot, view in self.sketches.owned_items()
                if not bool(torch.isfinite(view).all())
            ]
            where = (f"on this rank: {bad[:4]}{' ...' if len(bad) > 4 else ''}" if bad
                     else "on another rank")
            raise RuntimeError(
                f"non-finite LoGRA sketch at update {self.update_count + 1} ({where}); no "
                "weight was changed"
            )
        return False

    def _agreed(self, flags: dict[str, bool]) -> dict[str, bool]:
        """Each flag ANDed over the model-parallel and data-parallel groups (every rank)."""
        return agreed_flags(flags, (self.groups.mp, self.groups.dp), self.sketches.data.device)

    def _all_ranks_finite(self, flags: dict[str, bool]) -> bool:
        return all(self._agreed(flags).values())

    def _refuse(self, stage: str, detail: str) -> None:
        """Undo a prepared update (row moments back to before it) and raise."""
        self.abandon_update()
        raise RuntimeError(
            f"non-finite LoGRA {stage} at update {self.update_count + 1} ({detail}); the "
            "update was refused on every rank: no weight and no optimizer state was changed"
        )

    def get_main_grads_for_grad_norm(self) -> list[torch.Tensor]:
        raise RuntimeError(
            "LoGRA sketches stand for gradients of a different size; use "
            "LoGRAOptimizer.sketch_sq_norm (LoGRAChainedOptimizer does)"
        )

    def get_grad_norm(self) -> float:
        return math.sqrt(self.sketch_sq_norm())

    def clip_grad_norm(self, clip_grad: float) -> float:
        grad_norm = self.get_grad_norm()
        self.clip_sketches_(clip_grad, grad_norm)
        return grad_norm

    def count_zeros(self) -> float:
        return self._model_sum(
            lambda target: (self.sketches.owned_view(target.layer_key) == 0).sum())

    @torch.no_grad()
    def sketch_frobenius_sq(self) -> float:
        """``sum_l ||S_l||_F^2`` (the paper's reported "grad norm" is its square root)."""
        def share(target: SketchTarget) -> Any:
            # Row-parallel sketch rows are replicated over TP: count them once.
            if target.tp_partial and self.groups.tp_rank != 0:
                return 0.0
            return self.sketches.owned_view(target.layer_key).double().pow(2).sum()

        return self._model_sum(share)

    @torch.no_grad()
    def prepare_update(self) -> None:
        """Turn the reduced sketches into this step's directions ``D`` (in place).

        The mode may then scale all directions jointly (paper mode: so that the proposed update
        ``-sum D A`` has norm ``update_ratio * ||W_targets||``). Nothing is applied yet: the
        step scale, if any, looks at the proposal first (:meth:`decide_scale`). The directions
        and the ratio factor are checked for finiteness on every rank; a refusal raises with
        the row moments restored.
        """
        if self._prepared:
            raise RuntimeError("an update is already prepared; apply it before preparing another")
        # The rule advances the row moments in place; keep them (one float per row) so that a
        # refused update leaves the optimizer as it was.
        self._state_before = {
            name: tensor.clone() for name, tensor in self.direction.state_tensors().items()
        }
        self._prepared = True
        # MoE: experts that received no token keep their moments and get no update.
        self._idle = idle_experts(self.targets, self.sketches)
        idle_moments = row_moments_of(self.direction, self._idle)
        try:
            self.direction.apply_(
                self.sketches,
                DirectionContext(step=self.update_count + 1, row_groups=self.row_groups,
                                 expert_row_groups=self.expert_row_groups),
            )
            hold_idle_experts_(self.direction, self.sketches, idle_moments, self._idle)
        except Exception:
            self.abandon_update()
            raise
        direction_finite = local_finite(self.sketches.owned_segments())
        if not self._all_ranks_finite({"direction": direction_finite}):
            self._refuse("direction", f"logra.direction={self.direction.name}; this rank's "
                         f"directions {'are finite' if direction_finite else 'are not'}")
        try:
            kappa = self.mode.proposal_scale(self._weight_sq_norm, self.sketch_sq_norm)
        except Exception:
            self.abandon_update()
            raise
        if kappa is not None:
            if not self._all_ranks_finite({"ratio": local_finite(scalars=[kappa])}):
                self._refuse("update-ratio factor", f"on this rank kappa={kappa}, "
                             f"update_ratio={self.mode.update_ratio}")
            for segment in self.sketches.owned_segments():
                segment.mul_(kappa)

    def abandon_update(self) -> None:
        """Drop a prepared update: the row moments return to their values before it."""
        if self._state_before is not None:
            for name, tensor in self.direction.state_tensors().items():
                tensor.copy_(self._state_before[name])
        self._state_before = None
        self._checked = None
        self._prepared = False

    @torch.no_grad()
    def _weight_sq_norm(self) -> float:
        """``||W_targets||_F^2`` from the fp32 masters (or the fp32 weights), every share once,
        in float64 by row blocks (no float64 copy of a whole weight).

        Over the weights this update moves: an expert that received no token is left out (it
        gets no update), so the paper's ratio is the relative change of what changes, whatever
        the routing left idle (docs/moe.md)."""
        def share(target: SketchTarget) -> Any:
            if target.layer_key in self._idle:
                return 0.0
            master = self.masters.get(target.layer_key)
            rows = norm_block_rows(target.weight.shape[1])
            blocks = (master.fp32_row_blocks(rows) if master is not None
                      else target.weight.detach().split(rows))
            # Host masters sum on the host; the scalar joins the device's sums.
            return blockwise_sq_norm(blocks).to(self.sketches.data.device)

        return self._model_sum(share)

    def _step_size(self) -> tuple[float, float]:
        """``(lr, weight_decay)`` of the update, as the mode takes them from the scheduler."""
        group = self.param_groups[0]
        return self.mode.step_size(float(group["lr"]), float(group["weight_decay"]))

    @torch.no_grad()
    def proposal(self) -> ProposedUpdate:
        """The prepared update at scale 1 (weight decay aside), per target ``left = -lr D``,
        ``right = A``; collective over DP.

        With DP-sharded masters each rank holds only its own rows of D; the directions are then
        all-gathered over DP once (sketch-sized), since every rank probes its own sequences
        through its whole local model.
        """
        if not self._prepared:
            raise RuntimeError("prepare_update() first")
        lr, _ = self._step_size()
        full = self.sketches.gathered_data(dp_group=self.groups.dp,
                                           expert_dp_group=self.groups.expert_dp)
        directions = {}
        for target in self.targets:
            pieces = self.sketches.pieces(target.layer_key, data=full)
            rows = torch.cat([piece.view for piece in pieces], dim=0)
            directions[target.layer_key] = (rows.mul(-lr), self.projection_of(target))
        return ProposedUpdate(directions=directions, completed_updates=self.update_count)

    @torch.no_grad()
    def decide_scale(self) -> float:
        """The scale of the prepared update: the step scale's choice, or 1 without one."""
        if self.step_scale is None:
            return 1.0
        return self.step_scale(self.proposal())

    @torch.no_grad()
    def prepare_checked_update(self) -> float:
        """Prepare the update, decide its scale and check every merged factor; returns the
        scale. Collective. Nothing is applied: a caller that steps other optimizers does so
        only after this returned (so a refusal leaves their weights alone too)."""
        self.prepare_update()
        try:
            scale = self.decide_scale()
        except Exception:
            self.abandon_update()
            raise
        self._check_factors(scale)
        return scale

    def _merge_factors(self, scale: float) -> list[tuple[torch.Tensor, float]]:
        lr, _ = self._step_size()
        return [
            self.mode.merge_factor(self.sketches.owned_view(target.layer_key), scale, lr)
            for target in self.targets
        ]

    @torch.no_grad()
    def _check_factors(self, scale: float) -> None:
        """alpha, then every ``U = step_lr * factor`` (what is merged), finite on every rank."""
        if not self._prepared:
            raise RuntimeError("prepare_update() first")
        scale_ok = math.isfinite(scale) and scale >= 0.0
        factors = self._merge_factors(scale) if scale_ok else []
        flags = {
            "alpha": scale_ok,
            "factor": all(local_finite([factor * step_lr], [step_lr])
                          for factor, step_lr in factors),
        }
        agreed = self._agreed(flags)
        if not agreed["alpha"]:
            self._refuse("step scale", f"alpha={scale} on this rank; it must be finite and >= 0")
        if not agreed["factor"]:
            self._refuse("update factor U", f"alpha={scale}, lr={self._step_size()[0]}; this "
                         f"rank's factors {'are finite' if flags['factor'] else 'are not'}")
        self._checked = (scale, factors)

    @torch.no_grad()
    def apply_update(self, scale: float = 1.0) -> None:
        """Merge the prepared update times ``scale`` into the weights; refresh projections.

        Library: ``W <- (1 - s lr wd) W - s lr D A``. Paper: ``W <- W - round(s D) A`` with the
        factor rounded to ``logra.update_factor_dtype`` (the paper's runs round it to bf16).
        The factors are checked first (:meth:`prepare_checked_update` did so already when it
        returned this scale).
        """
        if not self._prepared:
            raise RuntimeError("prepare_update() first")
        if self._checked is None or self._checked[0] != scale:
            self._check_factors(scale)
        _, factors = self._checked
        _, weight_decay = self._step_size()
        records: list[LowRankUpdate] = []
        self._synchronize()
        merge_start = time.perf_counter()
        for target, (direction, step_lr) in zip(self.targets, factors, strict=True):
            # fp32 for the merge, one layer at a time (exact: A's values are the compute dtype's).
            projection = self.projection_of(target).float()
            master = self.masters.get(target.layer_key)
            if target.layer_key in self._idle:
                # An expert that received no token: no update at all (its factor is zero; no
                # weight decay either). Policy sync still gets its (identity) record.
                if self.update_listener is not None:
                    records.append(self._sync_record(target, direction, 0.0, 0.0))
                continue
            if self.update_listener is not None:
                records.append(self._sync_record(target, direction, step_lr, weight_decay))
            # (1 - step_lr * wd) with step_lr = scale * lr: the decay is scaled with the step
            # (paper mode has no decay, and its scale is folded into the rounded factor).
            if master is None:
                apply_low_rank_update_(target.weight.data, direction, projection, lr=step_lr,
                                       weight_decay=weight_decay)
            else:
                master.merge_(target.weight, direction, projection, lr=step_lr,
                              weight_decay=weight_decay, dp_group=self.master_group(target))
        self._synchronize()
        self.last_merge_time_s = time.perf_counter() - merge_start
        self.update_count += 1
        self.last_update_scale = scale
        self._prepared = False
        self._state_before = None
        self._checked = None
        if self.logra.refresh:
            self.refresh_projections()
        if self.update_listener is not None:
            self.update_listener(records)

    def master_group(self, target: SketchTarget) -> Any:
        """The group a target's master rows are sharded over (and its bf16 rows gathered)."""
        return self.groups.expert_dp if target.expert else self.groups.dp

    def _sync_record(self, target: SketchTarget, factor_OR: torch.Tensor, step_lr: float,
                     weight_decay: float) -> LowRankUpdate:
        """What this rank merges into ``target`` in the current update, for policy sync."""
        piece = FactorPiece(global_row_ranges(self, target), target.col_start, target.col_end,
                            host_factor(factor_OR))
        return LowRankUpdate(
            layer_key=target.layer_key, update_count=self.update_count + 1,
            seed=self.logra.seed, projection_count=self.update_count if self.logra.refresh else 0,
            distribution=self.logra.distribution, sketch_rank=self.sketch_rank_of(target),
            in_features=target.in_features,
            projection_dtype=str(self.compute_dtype).removeprefix("torch."),
            lr=step_lr, weight_decay=weight_decay, pieces=(piece,),
        )

    def _synchronize(self) -> None:
        """Wait for the device, so that a wall-clock interval measures the work inside it."""
        if self.sketches.data.is_cuda:
            torch.cuda.synchronize(self.sketches.data.device)

    def update_metrics(self) -> dict[str, object]:
        """The fields a step's record reports about the last update."""
        return {"logra_update_count": self.update_count,
                "master_merge_time_s": self.last_merge_time_s}

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self.apply_update(self.prepare_checked_update())
        return True

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, float | None]:
        """Stand-alone step (when LoGRA is the only optimizer)."""
        self.prepare_grads()
        grad_norm = None
        if self.config.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.config.clip_grad)
        return self.step_with_ready_grads(), grad_norm, None

    def reload_model_params(self, state_dict: Any = None) -> None:
        """Re-derive sharded masters from the (just loaded) model weights."""
        for target in self.targets:
            master = self.masters.get(target.layer_key)
            if master is not None:
                master.load_(self.master_weights.make(target.weight, master.shard).fp32_rows())

    def state_dict(self) -> dict[str, Any]:
        return {
            "update_count": self.update_count,
            "direction": {k: v.clone() for k, v in self.direction.state_tensors().items()},
            "masters": {k: m.fp32_rows().clone() for k, m in self.masters.items()},
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.param_groups
            ],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load either :meth:`state_dict` or a loaded :meth:`sharded_state_dict`."""
        if "row_pieces" in state_dict:
            load_sharded_state(self, state_dict)
            return
        self.update_count = int(state_dict["update_count"])
        for name, tensor in self.direction.state_tensors().items():
            tensor.copy_(state_dict["direction"][name])
        for key, master in self.masters.items():
            master.load_(state_dict["masters"][key])
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(saved)
        self.refresh_projections()

    def sharded_state_dict(
        self, model_sharded_state_dict: Any, is_loading: bool = False, metadata: Any = None
    ) -> dict[str, Any]:
        """Row moments and fp32 masters as ShardedTensors keyed by layer, reshardable to any
        TP / PP / DP layout; the update count, settings and step-scale state as common state
        (:mod:`megatron_logra.mcore.optimizer.logra_state`)."""
        del model_sharded_state_dict, is_loading, metadata
        return sharded_state_dict(self)
