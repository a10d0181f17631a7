"""The trainer's weights in the engine's terms: full (TP=1) tensors by global parameter name.

Policy sync speaks TP=1 names and shapes, whatever the layouts of the trainer and the engine
(docs/sync.md). This module assembles them on the trainer:

* :func:`served_weights`: every weight as the trainer computes with it (its own dtype), the
  TP shards gathered exactly as Megatron sliced them (``partition_stride`` included), the
  pipeline stages' names merged; what the engine must serve, and what the checksums compare.
  A LoRA target is served merged, ``W + (alpha/r) B A`` (fp32 products, one rounding to the
  weight's dtype), its adapters not at all: an engine serves a plain model (vLLM loads a Hugging
  Face checkpoint), so its rollouts differ from the trainer's unmerged forward by that rounding
  (the run's ``rollout_trainer_gap`` shows it);
* :func:`exact_state`: what a full sync ships. Non-targets as served; targets as their fp32
  masters (with bf16 weights the shadow must start from the exact master, not from the
  rounded weight), assembled from every rank's owned row blocks (``global_row_ranges``), so
  DP-sharded masters and TP shards both land in the full tensor.

Both are collective over the whole trainer world (``world_group``) and return the tensors on
every rank, on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_logra.mcore.models.sharding import gather_full, global_named_parameters, unwrap_model
from megatron_logra.mcore.models.targets import TARGET_PATHS
from megatron_logra.mcore.optimizer.logra_state import global_row_ranges
from megatron_logra.mcore.peft.lora import ADAPTER_ATTR, lora_adapters
from megatron_logra.mcore.process_groups import ParallelGroups


def target_param_names(target_names: Sequence[str], num_layers: int) -> list[str]:
    """The global parameter names of the LoGRA targets of a ``num_layers`` GPT (the engine's
    shadow holds exactly these as fp32 masters)."""
    return [f"decoder.layers.{layer}.{TARGET_PATHS[name][0]}.weight"
            for layer in range(num_layers) for name in target_names]


def _stage_parameters(
    model_chunks: Sequence[torch.nn.Module],
) -> Iterator[tuple[str, torch.nn.Parameter]]:
    for chunk in model_chunks:
        tied = getattr(unwrap_model(chunk), "share_embeddings_and_output_weights", False)
        for name, param in global_named_parameters(chunk):
            if name == "output_layer.weight" and tied:
                continue  # the last stage's copy of the tied word embeddings
            yield name, param


def _merge_stages(stage: dict, groups: ParallelGroups) -> dict:
    if groups.pp_size == 1:
        return stage
    stages: list[dict | None] = [None] * groups.pp_size
    dist.all_gather_object(stages, stage, group=groups.pp)
    merged: dict = {}
    for entry in stages:
        merged.update(entry or {})
    return merged


def served_weights(
    model_chunks: Sequence[torch.nn.Module], groups: ParallelGroups,
    *, names: frozenset[str] | None = None,
) -> dict[str, torch.Tensor]:
    """``{global name: full tensor}`` in each parameter's own dtype (``names``: only those).
    Collective over the TP and pipeline groups."""
    stage = {name: gather_full(param, groups.tp, groups.tp_size).cpu()
             for name, param in _stage_parameters(model_chunks)
             if names is None or name in names}
    return _merge_stages(_merge_lora(stage, model_chunks), groups)


def _merge_lora(stage: dict[str, torch.Tensor], model_chunks: Sequence[torch.nn.Module]
                ) -> dict[str, torch.Tensor]:
    """The full tensors with each LoRA adapter merged into its target's weight."""
    scales = {a.layer_key: a.scale for a in lora_adapters(model_chunks)}
    for key, scale in scales.items():
        a = stage.pop(f"{key}.{ADAPTER_ATTR}.a", None)
        b = stage.pop(f"{key}.{ADAPTER_ATTR}.b", None)
        weight = stage.get(f"{key}.weight")
        if a is None or b is None or weight is None:
            continue  # not among the names asked for
        merged = weight.float().addmm_(b.float(), a.float(), alpha=scale)
        stage[f"{key}.weight"] = merged.to(weight.dtype)
    return stage


def trainable_non_targets(
    model_chunks: Sequence[torch.nn.Module], target_names: frozenset[str],
) -> frozenset[str]:
    """Names of the non-target parameters the native optimizer trains (library mode's Adam:
    embeddings, norms, biases); on this rank's stages."""
    return frozenset(name for name, param in _stage_parameters(model_chunks)
                     if param.requires_grad and name not in target_names)


def exact_state(setup, groups: ParallelGroups, world_group: dist.ProcessGroup
                ) -> dict[str, torch.Tensor]:
    """The full-sync state: served non-targets, fp32 masters (or fp32 weights) of the targets.
    Collective over ``world_group`` (the whole trainer)."""
    logra = setup.logra
    targets = {} if logra is None else {f"{t.layer_key}.weight": t for t in logra.targets}
    state = served_weights(setup.model_chunks, groups)
    if not targets:
        return state
    mine = {}
    for name, target in targets.items():
        master = logra.masters.get(target.layer_key)
        rows = master.fp32_rows() if master is not None else target.weight.detach()
        if rows.dtype != torch.float32:
            raise RuntimeError(f"{name}: a full sync needs the fp32 master, the trainer holds "
                               f"{rows.dtype} rows")
        mine[name] = (global_row_ranges(logra, target), target.col_start, target.col_end,
                      target.in_features, rows.cpu().clone())
    gathered: list[dict | None] = [None] * dist.get_world_size(world_group)
    dist.all_gather_object(gathered, mine, group=world_group)
    full: dict[str, torch.Tensor] = {}
    for rank_blocks in gathered:
        for name, (ranges, col_start, col_end, in_features, rows) in (rank_blocks or {}).items():
            if name not in full:
                height = state[name].shape[0]
                full[name] = torch.zeros(height, in_features, dtype=torch.float32)
            start = 0
            for lo, hi in ranges:
                # Replicas (DP copies of unsharded rows) write the same values again.
                full[name][lo:hi, col_start:col_end] = rows[start : start + hi - lo]
                start += hi - lo
    return {name: full.get(name, tensor) for name, tensor in state.items()}
