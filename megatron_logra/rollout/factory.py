"""``make_engine(cfg)``: the separate rollout engine ``rollout.engine`` names, not started."""

from __future__ import annotations

import importlib
from pathlib import Path

from megatron_logra.config import Config
from megatron_logra.rollout.engine import GenerationEngine

VLLM_CLIENT_MODULE = "megatron_logra.rollout.vllm_engine"


def engine_dir(cfg: Config) -> Path:
    """Where a separate engine keeps its files (logs; vLLM's Hugging Face checkpoint)."""
    return Path(cfg.run.dir) / "engine"


def make_engine(cfg: Config) -> GenerationEngine:
    if cfg.rollout.engine == "megatron":
        from megatron_logra.rollout.megatron_engine import MegatronEngine

        return MegatronEngine(cfg, engine_dir(cfg))
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
        return module.VLLMEngine(cfg, engine_dir(cfg) / "hf")
    raise ValueError(f"rollout.engine={cfg.rollout.engine!r} is not one of megatron, vllm")
