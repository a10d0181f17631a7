"""``make_engine(cfg)``: the separate rollout engine ``rollout.engine`` names, not started.

vLLM serves the Hugging Face checkpoint in ``vllm_checkpoint_dir(cfg)``, which the trainer
writes before it starts the engine (``megatron_logra.train.rl.engine_checkpoint``)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path

from megatron_logra.config import Config
from megatron_logra.rollout.engine import GenerationEngine
from megatron_logra.rollout.vllm_setup import DEFAULT_VLLM_VENV, vllm_setup_problem

VLLM_CLIENT_MODULE = "megatron_logra.rollout.vllm_engine"


def engine_dir(cfg: Config) -> Path:
    """Where a separate engine keeps its files (logs; vLLM's Hugging Face checkpoint)."""
    return Path(cfg.run.dir) / "engine"


def vllm_checkpoint_dir(cfg: Config) -> Path:
    """The Hugging Face checkpoint a vLLM engine loads (the trainer writes it at RL start)."""
    return engine_dir(cfg) / "hf"


# model.params_dtype -> vLLM's dtype: the engine serves exactly the trainer's weights.
_VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def vllm_venv(cfg: Config) -> Path:
    """The venv the vLLM engine runs in (``rollout.vllm_venv``)."""
    return Path(cfg.rollout.vllm_venv) if cfg.rollout.vllm_venv else DEFAULT_VLLM_VENV


def check_engine_setup(cfg: Config) -> None:
    """Refuse, before any rank starts, a separate engine whose installation cannot run:
    ValueError naming the field, the value and the fix."""
    if not cfg.rollout.separate or cfg.rollout.engine != "vllm":
        return  # the Megatron engine runs from this venv, as the trainer does
    problem = vllm_setup_problem(vllm_venv(cfg), f"rollout.vllm_venv={cfg.rollout.vllm_venv!r}")
    if problem is not None:
        raise ValueError(f"rollout.engine=vllm: {problem}")


def _vllm_engine(module, cfg: Config, target_names: Sequence[str]) -> GenerationEngine:
    return module.VLLMEngine(
        vllm_checkpoint_dir(cfg), target_names=target_names, tensor_parallel=cfg.rollout.tp,
        dtype=_VLLM_DTYPES[cfg.model.params_dtype], max_model_len=cfg.model.seq_length,
        seed=cfg.rl.seed, venv=vllm_venv(cfg), log_path=engine_dir(cfg) / "vllm.log",
        start_timeout_s=cfg.rollout.start_timeout_s,
        request_timeout_s=cfg.rollout.request_timeout_s, transport=cfg.sync.transport,
        channel_device=cfg.parallel.device, devices=cfg.rollout.devices, cpus=cfg.rollout.cpus)


def make_engine(cfg: Config, target_names: Sequence[str] = ()) -> GenerationEngine:
    """``target_names``: the LoGRA targets' Megatron names (``<layer_key>.weight``), of which
    the engine keeps an exact fp32 shadow (none where no low-rank records arrive)."""
    if cfg.rollout.engine == "megatron":
        from megatron_logra.rollout.megatron_engine import MegatronEngine

        return MegatronEngine(cfg, engine_dir(cfg), target_names)
    if cfg.rollout.engine == "vllm":
        try:
            module = importlib.import_module(VLLM_CLIENT_MODULE)
        except ModuleNotFoundError as error:
            if error.name != VLLM_CLIENT_MODULE:
                raise
            raise RuntimeError(
                f"rollout.engine=vllm needs the vLLM client ({VLLM_CLIENT_MODULE}), which this "
                "installation lacks; use rollout.engine=megatron"
            ) from error
        return _vllm_engine(module, cfg, target_names)
    raise ValueError(f"rollout.engine={cfg.rollout.engine!r} is not one of megatron, vllm")
