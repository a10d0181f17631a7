"""The Hugging Face checkpoint a vLLM rollout engine loads, written from the trainer's policy.

vLLM builds its model from a checkpoint directory, so at RL start (``rollout.engine=vllm``) the
trainer writes its served weights there through our converter (``megatron_logra.mcore.
conversion``): ``config.json`` from the model section (Llama, or Qwen2 for q/k/v-only biases),
the tensors by ``hf_tensors_from_megatron``, and the run's stop tokens (EOS, the chat template's
end of turn, ...) as ``eos_token_id`` in ``config.json`` and ``generation_config.json`` -- vLLM
runs without a tokenizer (token ids in, token ids out); every generate request also names the
set, so both say the same. The full sync that follows the start overwrites
every weight with the exact state, so the file's values only have to be the policy's shapes
and dtype; writing the policy itself keeps the directory a usable snapshot of the start.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_logra.config import Config
from megatron_logra.mcore import ParallelGroups
from megatron_logra.mcore.conversion import (
    HF_CONFIG_FILE,
    HF_GENERATION_CONFIG_FILE,
    architecture_from_hf_config,
    hf_config_from_model_config,
    hf_tensors_from_megatron,
    write_safetensors,
)
from megatron_logra.mcore.models.sync_state import served_weights
from megatron_logra.train.rl.collectives import from_world_rank0

SERVED_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``model.params_dtype`` -> the dtype the engine serves (the trainer's weights)."""


def write_engine_checkpoint(cfg: Config, setup, groups: ParallelGroups, hf_dir: Path, *,
                            vocab_size: int, stop_ids: tuple[int, ...]) -> None:
    """Write the policy as a Hugging Face checkpoint into ``hf_dir`` (world rank 0; collective
    over the trainer: every rank gathers, an error on rank 0 is raised on all).

    ``vocab_size`` is the embedding's rows before padding (the checkpoint's vocabulary)."""
    weights = served_weights(setup.model_chunks, groups)

    def write() -> None:
        dtype = SERVED_DTYPES[cfg.model.params_dtype]
        try:
            config = hf_config_from_model_config(cfg.model, vocab_size=vocab_size, dtype=dtype)
        except ValueError as error:
            raise ValueError(f"rollout.engine=vllm serves a Hugging Face model, and this one "
                             f"has none: {error}; use rollout.engine=megatron") from error
        config["eos_token_id"] = list(stop_ids)
        tensors = hf_tensors_from_megatron(weights, architecture_from_hf_config(config))
        hf_dir.mkdir(parents=True, exist_ok=True)
        write_safetensors({n: t.to(dtype).contiguous() for n, t in tensors.items()}, hf_dir)
        (hf_dir / HF_CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
        (hf_dir / HF_GENERATION_CONFIG_FILE).write_text(
            json.dumps({"eos_token_id": list(stop_ids)}, indent=1) + "\n")

    from_world_rank0(write, f"writing the vLLM engine's checkpoint to {hf_dir}")
