"""Everything that touches Megatron-Core, and the only package that imports ``megatron.core``.

Grouped the way Megatron-Core groups its own code:

* ``process_groups``: torch.distributed and Megatron's model parallelism for a run, handed to
  everything below as an explicit :class:`ParallelGroups`;
* ``tensor_parallel/``: the sketch-capable Column/RowParallelLinear and the sequence-parallel
  collectives they use;
* ``models/``: the GPT the product builds (layer spec, layout-invariant initialisation), the
  sketched targets, sharding helpers, full-weight gathering;
* ``optimizer/``: LoGRA as a ``MegatronOptimizer``, chained with Megatron's own, and its
  reshardable checkpoint state;
* ``training/``: DDP + optimizers + scheduler for a run, the one call into Megatron's
  forward/backward schedules, a supervised step, persistent-state accounting;
* ``kl_probe/``: the logits' JVP along a proposed low-rank update and the predicted-KL step
  control built on it;
* ``inference/``: the built-in rollout engine (KV-cache sampling) and per-token log-probs;
* ``checkpointing/``, ``conversion/`` (Hugging Face), ``peft/`` (LoRA);
* ``compat/``: every runtime patch of Megatron (CPU over gloo, bug fixes, forward-mode AD rules)
  -- the checklist for a megatron-core upgrade.

The names below are the API the trainers (``megatron_logra.train``) use.
"""

# isort: off
# First, before anything imports megatron.core: without CUDA its fused helpers stay eager.
from megatron_logra.mcore.compat import eager_fusions  # noqa: F401
# isort: on

from megatron_logra.mcore.checkpointing.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_model_weights,
    remove_stale_staging,
    save_checkpoint,
    save_model_checkpoint,
)
from megatron_logra.mcore.inference.sampler import MegatronSampler
from megatron_logra.mcore.inference.token_logprobs import (
    compute_packed_token_logprobs,
    compute_token_logprobs,
    token_logprobs_from_logits,
)
from megatron_logra.mcore.kl_probe.step_control import KLStepControl
from megatron_logra.mcore.models.full_weights import gather_full_weights, save_tensors_atomically
from megatron_logra.mcore.models.gpt import build_model_chunks
from megatron_logra.mcore.models.packed_attention import packed_seq_params
from megatron_logra.mcore.process_groups import ParallelGroups, destroy_parallel, init_parallel
from megatron_logra.mcore.training.forward_backward import forward_backward
from megatron_logra.mcore.training.setup import TrainingSetup, setup_training
from megatron_logra.mcore.training.state_bytes import (
    gather_state_bytes,
    state_bytes_totals,
    write_state_bytes,
)
from megatron_logra.mcore.training.step import StepResult, train_step

__all__ = [
    "KLStepControl", "MegatronSampler", "ParallelGroups", "StepResult",
    "TrainingSetup", "build_model_chunks", "compute_packed_token_logprobs",
    "compute_token_logprobs", "destroy_parallel",
    "forward_backward", "gather_full_weights", "gather_state_bytes", "init_parallel",
    "latest_checkpoint", "load_checkpoint", "load_model_weights", "packed_seq_params",
    "remove_stale_staging",
    "save_checkpoint",
    "save_model_checkpoint", "save_tensors_atomically", "setup_training",
    "state_bytes_totals", "token_logprobs_from_logits", "train_step", "write_state_bytes",
]
