"""Checkpoints through Megatron's ``dist_checkpointing``: exact, reshardable, atomic.

A checkpoint holds the model, Megatron's optimizer, LoGRA's state (row moments, fp32 masters,
update count and the settings they depend on), the LR scheduler, the training step (which is the
data position: batches are a pure function of the step) and each rank's RNG state. Tensors are
sharded by their global identity, so a checkpoint written at one TP/PP/DP layout loads at another.

Layout of ``checkpoint.dir``::

    iter_0000012/              complete checkpoints (dist_checkpointing files + manifest.json)
    .staging-iter_0000014-*/   a save in progress (or one killed mid-way): never loaded
    latest_checkpointed_iteration.txt

Atomicity: every rank writes into a staging directory; after all ranks finish, the files are
hashed (the work spread over the ranks), rank 0 writes ``manifest.json`` into the staging
directory and only then renames it to ``iter_NNNNNNN``. A directory without a manifest is not a
checkpoint. On load every file is checked against the manifest (size and SHA-256) before any
tensor is read, and a mismatch names the file.

Durability (a node crash, not only a killed process): the hashing pass fsyncs every file it
reads, rank 0 fsyncs the staging directories, the manifest is written with fsync, and the
checkpoint directory is fsynced after each rename (and after ``latest_checkpointed_iteration``).
Each save and each verified load logs what hashing cost (files, bytes, seconds). Staging
directories a killed save left behind are removed at start-up (:func:`remove_stale_staging`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from torch.distributed.checkpoint.api import CheckpointException

from megatron_logra import checkpoint_files
from megatron_logra.atomic_write import fsync_directory, write_atomically
from megatron_logra.checkpoint_files import HashCost, fsync_directories, hash_files, staging_name
from megatron_logra.config import Config
from megatron_logra.mcore.compat.megatron_fixes import apply_megatron_fixes, untie_adam_steps
from megatron_logra.mcore.models.sharding import unwrap_model
from megatron_logra.mcore.process_groups import ParallelGroups
from megatron_logra.mcore.training.setup import TrainingSetup

logger = logging.getLogger(__name__)

PREFIX = "iter_"
MANIFEST = "manifest.json"
LATEST_FILE = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1
# Test hook: set to a step number to SIGKILL rank 0 while it saves that step, after the shards
# are written and before the checkpoint is published -- a save killed half-way must never leave
# a checkpoint that loads as valid.
KILL_DURING_SAVE_ENV = "MEGATRON_LOGRA_TEST_KILL_DURING_SAVE"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:07d}"


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every published checkpoint under ``root``, oldest first."""
    root = Path(root)
    found = []
    if root.is_dir():
        for path in root.iterdir():
            if path.is_dir() and path.name.startswith(PREFIX) and (path / MANIFEST).is_file():
                found.append((int(path.name[len(PREFIX):]), path))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


# ----------------------------------------------------------------------------- state


def _model_keys(index: int, count: int) -> str:
    return f"model{index}" if count > 1 else "model"


def _rng_object(groups: ParallelGroups, is_loading: bool) -> ShardedObject:
    """Each rank's RNG states, addressed by its (pp, tp, dp) coordinates."""
    state = None if is_loading else {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if groups.device.type == "cuda" else None,
    }
    return ShardedObject(
        "rng_state",
        state,
        (groups.pp_size, groups.tp_size, groups.dp_size),
        (groups.pp_rank, groups.tp_rank, groups.dp_rank),
        replica_id=0,
    )


def _allocate_distributed_optimizer_state(setup: TrainingSetup) -> None:
    """Give a fresh distributed optimizer its Adam state before loading into it.

    Megatron 0.16's DistributedOptimizer reads the Adam ``step`` while building the sharded
    state dict to load into, which a fresh torch Adam does not have yet. Megatron provides a
    dummy step for exactly this (zero gradients, one inner step): the state it creates, and any
    change it makes to the main parameters, is overwritten by the load.
    """
    for optimizer in getattr(setup.optimizer, "chained_optimizers", [setup.optimizer]):
        if isinstance(optimizer, DistributedOptimizer) and not optimizer.optimizer.state:
            optimizer._init_optimizer_states_with_dummy_values()


def _sharded_state(
    setup: TrainingSetup, groups: ParallelGroups, *, is_loading: bool, with_rng: bool
) -> dict[str, Any]:
    if is_loading:
        _allocate_distributed_optimizer_state(setup)
    state: dict[str, Any] = {}
    chunks = setup.model_chunks
    for index, chunk in enumerate(chunks):
        # The GPTModel itself: DDP would prefix every key with "module.".
        state[_model_keys(index, len(chunks))] = unwrap_model(chunk).sharded_state_dict()
    # The chunks' state dicts stay nested: their keys are local layer names, which repeat
    # across virtual stages (Megatron walks nested values to map parameters).
    model_states = {key: state[key] for key in (_model_keys(i, len(chunks))
                                                for i in range(len(chunks)))}
    # Megatron's reshardable format for the distributed optimizer (its default format relies on
    # flattened ranges that dist_checkpointing no longer accepts).
    state["optimizer"] = setup.optimizer.sharded_state_dict(
        model_states, is_loading=is_loading,
        metadata={"distrib_optim_sharding_type": "fully_reshardable"},
    )
    if with_rng:
        state["rng_state"] = _rng_object(groups, is_loading)
    return state


def _layout(groups: ParallelGroups) -> dict[str, int]:
    layout = {"tp": groups.tp_size, "pp": groups.pp_size, "vpp": groups.vpp_size,
              "dp": groups.dp_size}
    # dp counts DP x CP ranks; cp is named only when used, so cp = 1 layouts read as before.
    return {**layout, "cp": groups.cp_size} if groups.cp_size > 1 else layout


# ----------------------------------------------------------------------------- manifest


def _files(directory: Path) -> list[str]:
    return sorted(
        str(p.relative_to(directory)) for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST
    )


def _hash_shared(
    directory: Path, names: Sequence[str], groups: ParallelGroups, *, purpose: str, sync: bool
) -> dict[str, str]:
    """SHA-256 of every file, each rank hashing (and with ``sync`` fsyncing) every
    world_size-th file, gathered everywhere; rank 0 logs the cost."""
    mine, cost = hash_files(directory, names[groups.world_rank::groups.world_size], sync=sync)
    gathered: list[tuple[dict[str, str], HashCost] | None] = [None] * groups.world_size
    dist.all_gather_object(gathered, (mine, cost))
    hashes: dict[str, str] = {}
    for part in gathered:
        hashes.update(part[0] if part else {})
    if groups.world_rank == 0:
        total = HashCost.total(part[1] for part in gathered if part)
        logger.info("checkpoint hashing (%s) of %s: %s over %d ranks", purpose, directory,
                    total.describe(), groups.world_size)
    return hashes


def remove_stale_staging(root: str | Path, groups: ParallelGroups) -> None:
    """Remove the staging directories a killed save left in ``root`` (rank 0; collective).
    Only directories named as this module's saves name them; nothing else is touched."""
    if groups.world_rank == 0:
        for path in checkpoint_files.remove_stale_staging(Path(root)):
            logger.warning("removed %s, left by a save that did not finish", path)
    dist.barrier()


def verify_checkpoint(path: Path, groups: ParallelGroups) -> dict[str, Any]:
    """Check every file against the manifest; raise ValueError naming what is wrong."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"{path} is not a complete checkpoint: it has no {MANIFEST}")
    try:
        manifest = json.loads(manifest_path.read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
    except (json.JSONDecodeError, KeyError) as error:
        raise ValueError(f"{manifest_path} is corrupt ({error}); the checkpoint cannot be "
                         "trusted") from error
    present = set(_files(path))
    missing = sorted(set(files) - present)
    if missing:
        raise ValueError(f"checkpoint {path} is incomplete: missing {missing[:5]}")
    for name, entry in files.items():
        size = (path / name).stat().st_size
        if size != entry["size"]:
            raise ValueError(
                f"checkpoint file {path / name} is corrupt: {size} bytes, manifest says "
                f"{entry['size']}"
            )
    hashes = _hash_shared(path, sorted(files), groups, purpose="load", sync=False)
    corrupt = sorted(name for name, entry in files.items() if hashes[name] != entry["sha256"])
    if corrupt:
        raise ValueError(
            f"checkpoint file(s) {[str(path / n) for n in corrupt[:5]]} are corrupt: their "
            "SHA-256 does not match the manifest written at save time"
        )
    return manifest


# ----------------------------------------------------------------------------- save / load


def save_checkpoint(
    root: str | Path,
    *,
    step: int,
    setup: TrainingSetup,
    cfg: Config,
    groups: ParallelGroups,
    extra_common: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint of the state after ``step`` completed steps; collective."""
    root = Path(root)
    state = _sharded_state(setup, groups, is_loading=False, with_rng=True)
    state["common"] = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "scheduler": setup.scheduler.state_dict(),
        "config": cfg.to_dict(),
        "layout": _layout(groups),
        **(extra_common or {}),
    }
    final = _save_atomically(root, checkpoint_name(step), state, groups,
                             header={"step": step}, kill_hook_step=step)
    if groups.world_rank == 0:
        write_atomically(root / LATEST_FILE, f"{step}\n")
        logger.info("saved checkpoint %s", final)
    dist.barrier()
    return final


def _save_atomically(
    root: Path, name: str, state: dict[str, Any], groups: ParallelGroups, *,
    header: dict[str, Any], kill_hook_step: int | None = None,
) -> Path:
    """Save ``state`` with dist_checkpointing into a staging directory, write the manifest
    (``header``, layout, every file's size and sha256) last, and rename the directory to
    ``root/name``; collective. A crash at any point leaves no directory named ``name`` that is
    incomplete, and an existing ``root/name`` is retired only once its replacement is whole."""
    final = root / name
    token = [uuid.uuid4().hex[:8]]
    dist.broadcast_object_list(token, src=0)
    staging = root / staging_name(name, token[0])
    if groups.world_rank == 0:
        staging.mkdir(parents=True, exist_ok=False)
    dist.barrier()
    try:
        dist_checkpointing.save(state, str(staging))
        dist.barrier()
        if groups.world_rank == 0 and kill_hook_step is not None and \
                os.environ.get(KILL_DURING_SAVE_ENV) == str(kill_hook_step):
            logger.error("test hook %s: killing rank 0 mid-save", KILL_DURING_SAVE_ENV)
            os.kill(os.getpid(), signal.SIGKILL)
        names = _files(staging)
        # Each file fsynced by the rank that hashes it: its bytes are on disk before the manifest.
        hashes = _hash_shared(staging, names, groups, purpose="save", sync=True)
        if groups.world_rank == 0:
            fsync_directories(staging)
            manifest = {
                "format_version": FORMAT_VERSION,
                **header,
                "layout": _layout(groups),
                "files": {n: {"size": (staging / n).stat().st_size, "sha256": hashes[n]}
                          for n in names},
            }
            write_atomically(staging / MANIFEST, json.dumps(manifest, indent=1))
            if final.exists():
                # Re-saving (e.g. a step after a resume): retire the old copy only now that the new
                # one is complete.
                retired = root / staging_name(name, uuid.uuid4().hex[:8], retired=True)
                os.replace(final, retired)
                os.replace(staging, final)
                fsync_directory(root)
                shutil.rmtree(retired)
            else:
                os.replace(staging, final)
            fsync_directory(root)
    except (OSError, CheckpointException) as error:
        # A full disk or an exhausted quota: dist_checkpointing's writer processes report it
        # as a CheckpointException (on every rank), our own writes as an OSError.
        raise _save_failed(error, root, name, staging) from error
    dist.barrier()
    return final


def _save_failed(error: BaseException, root: Path, name: str, staging: Path) -> RuntimeError:
    """The error of a save that could not write its files. The half-written staging directory
    is removed (it holds space the user needs back; start-up would remove it anyway); nothing
    that was published before is touched."""
    unfinished = staging.is_dir()
    shutil.rmtree(staging, ignore_errors=True)
    free = shutil.disk_usage(root).free if root.is_dir() else 0
    previous = latest_checkpoint(root)
    cause = str(error).strip().splitlines()
    return RuntimeError(
        f"could not write checkpoint {name} in {root} ({type(error).__name__}: "
        f"{cause[-1] if cause else error!r}); a full disk or quota shows like this "
        f"({free / 2**20:.1f} MiB free there now). "
        f"{'The unfinished save was removed. ' if unfinished else ''}"
        + (f"The newest complete checkpoint, {previous.name}, is untouched and loadable: free "
           "space (or point checkpoint.dir at another file system) and rerun with "
           "checkpoint.resume=true" if previous else
           "No earlier checkpoint exists: free space (or point checkpoint.dir at another file "
           "system) and rerun")
    )


def load_checkpoint(
    path: str | Path, *, setup: TrainingSetup, cfg: Config, groups: ParallelGroups,
    verify: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into ``setup`` (any layout); returns its common state (step, ...)."""
    path = Path(path)
    apply_megatron_fixes()
    if verify:
        verify_checkpoint(path, groups)
    common = dist_checkpointing.load_common_state_dict(str(path))["common"]
    if common.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path} has format version {common.get('format_version')}, this "
            f"version of megatron_logra reads {FORMAT_VERSION}"
        )
    _check_model_matches(common["config"], cfg, path)
    same_layout = common["layout"] == _layout(groups)
    state = _sharded_state(setup, groups, is_loading=True, with_rng=same_layout)
    try:
        loaded = dist_checkpointing.load(state, str(path))
    except Exception as error:
        raise RuntimeError(f"checkpoint {path} could not be loaded: {error}") from error
    chunks = setup.model_chunks
    for index, chunk in enumerate(chunks):
        unwrap_model(chunk).load_state_dict(loaded[_model_keys(index, len(chunks))])
    setup.optimizer.load_state_dict(loaded["optimizer"])
    untie_adam_steps(setup.optimizer)
    setup.scheduler.load_state_dict(common["scheduler"])
    if same_layout:
        rng = loaded["rng_state"]
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None:
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        logger.warning(
            "checkpoint %s was written at layout %s, this run is %s: model and optimizer "
            "state are resharded; per-rank RNG states are not restored", path,
            common["layout"], _layout(groups),
        )
    return common


_MODEL_SHAPE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "normalization", "activation", "position_embedding", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "untie_embeddings", "make_vocab_size_divisible_by", "params_dtype",
)
# Fields added after checkpoints were written without them: their value then (the default).
_MODEL_SHAPE_DEFAULTS: dict[str, Any] = {"qk_layernorm": False}


# Optimizer settings that decide what optimizer state a checkpoint holds.
_OPTIMIZER_STATE_FIELDS = ("name", "use_distributed_optimizer")


def _check_model_matches(
    saved: dict[str, Any], cfg: Config, path: Path, *, check_optimizer: bool = True
) -> None:
    current = cfg.to_dict()
    model = {name: saved["model"].get(name, _MODEL_SHAPE_DEFAULTS.get(name))
             for name in _MODEL_SHAPE_FIELDS}
    mismatched = [
        f"model.{name}: checkpoint {model[name]!r} vs run {current['model'][name]!r}"
        for name in _MODEL_SHAPE_FIELDS if model[name] != current["model"][name]
    ] + [
        f"optimizer.{name}: checkpoint {saved['optimizer'].get(name)!r} vs run "
        f"{current['optimizer'][name]!r}"
        for name in _OPTIMIZER_STATE_FIELDS
        if check_optimizer and saved["optimizer"].get(name) != current["optimizer"][name]
    ]
    if check_optimizer and cfg.optimizer.name == "logra" and \
            saved["logra"].get("native_optimizer") != cfg.logra.native_optimizer:
        mismatched.append(
            f"logra.native_optimizer: checkpoint {saved['logra'].get('native_optimizer')!r} vs "
            f"run {cfg.logra.native_optimizer!r}"
        )
    if mismatched:
        raise ValueError(
            f"checkpoint {path} was written for a different model or optimizer "
            f"({'; '.join(mismatched)}); resume with the settings it was written with"
        )


def save_model_checkpoint(
    root: str | Path, *, model_chunks: Sequence[torch.nn.Module], cfg: Config,
    groups: ParallelGroups, name: str = "model",
) -> Path:
    """A model-only checkpoint (weights, no optimizer): a warm start's output, a converted
    Hugging Face model, or any starting point ``model.init_checkpoint`` can load at any layout.

    Written with the same atomic staging + manifest protocol as a training checkpoint.
    """
    state: dict[str, Any] = {
        _model_keys(i, len(model_chunks)): unwrap_model(chunk).sharded_state_dict()
        for i, chunk in enumerate(model_chunks)
    }
    state["common"] = {"format_version": FORMAT_VERSION, "model_only": True,
                       "config": cfg.to_dict(), "layout": _layout(groups)}
    return _save_atomically(Path(root), name, state, groups, header={"model_only": True})


def load_model_weights(
    path: str | Path, *, model_chunks: Sequence[torch.nn.Module], cfg: Config,
    groups: ParallelGroups, verify: bool = True,
) -> None:
    """Load only the model weights of a checkpoint (model-only or full), at any layout."""
    path = Path(path)
    if verify:
        verify_checkpoint(path, groups)
    common = dist_checkpointing.load_common_state_dict(str(path))["common"]
    _check_model_matches(common["config"], cfg, path, check_optimizer=False)
    state = {
        _model_keys(i, len(model_chunks)): unwrap_model(chunk).sharded_state_dict()
        for i, chunk in enumerate(model_chunks)
    }
    try:
        loaded = dist_checkpointing.load(state, str(path))
    except Exception as error:
        raise RuntimeError(f"model weights in {path} could not be loaded: {error}") from error
    for index, chunk in enumerate(model_chunks):
        unwrap_model(chunk).load_state_dict(loaded[_model_keys(index, len(model_chunks))])
