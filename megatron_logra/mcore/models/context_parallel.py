"""Context parallelism switched off for a while on a CP-built GPT: whole sequences per rank.

A model built with ``context_parallel_size > 1`` expects each rank's two chunks of every
sequence: its rotary embedding selects those chunks' positions (Megatron's
``get_pos_emb_on_this_cp_rank``) and its attention gathers the other ranks' keys and values.
The built-in sampler instead gives every CP rank whole sequences of its own -- the CP ranks of a
replica generate as extra data-parallel generators, with the same weights -- so for the duration
of :func:`context_parallel_off` the model attends within its rank's tokens and takes rotary
positions ``0..s-1``, as a model built without CP does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel

from megatron_logra.mcore.models.sdpa_attention import SDPAttention


@contextlib.contextmanager
def context_parallel_off(model: GPTModel) -> Iterator[None]:
    """Run ``model`` (unwrapped) without its context parallelism; restored on exit."""
    config = model.config
    if config.context_parallel_size == 1:
        yield
        return
    attentions = [module for module in model.modules()
                  if type(module).__name__.endswith("DotProductAttention")]
    if attentions:
        raise ValueError(
            f"the built-in sampler runs a parallel.cp={config.context_parallel_size} model with "
            f"its CP ranks as extra generators, which needs model.attention=sdpa (this model "
            f"has {type(attentions[0]).__name__}); use model.attention=sdpa or "
            "rollout.placement=separate"
        )
    layers = [(module, module.cp_group) for module in model.modules()
              if isinstance(module, SDPAttention)]
    rotary = getattr(model, "rotary_pos_emb", None)
    rotary_group = getattr(rotary, "cp_group", None)
    size = config.context_parallel_size
    try:
        config.context_parallel_size = 1
        for module, _ in layers:
            module.cp_group = None
        if rotary is not None:
            rotary.cp_group = None
        # The rotary table is cached by sequence length alone: drop the chunk-sliced entries.
        RotaryEmbedding.forward.cache_clear()
        yield
    finally:
        config.context_parallel_size = size
        for module, group in layers:
            module.cp_group = group
        if rotary is not None:
            rotary.cp_group = rotary_group
        RotaryEmbedding.forward.cache_clear()
