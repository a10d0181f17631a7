"""Megatron-LM's theoretical-memory formula for a dense GPT, reimplemented to cross-check the
estimate of dense Adam (:func:`megatron_logra.memory.estimate.dense_adam_memory`)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_logra.memory.shapes import Layout, ModelShape


@dataclass(frozen=True)
class MegatronFormula:
    """Megatron-LM's theoretical memory of dense training on the first pipeline stage (bytes).

    Attributes:
        weight_and_optimizer: parameters of the most loaded shard times 18 (or 6 + 12/dp).
        activations: the activation estimate of the branch Megatron picks.
        per_layer_activations: one layer's activations per microbatch in that branch.
        branch: ``sequence_parallel_selective`` (Korthikanti's ``sbh(18 + 4F/h)/t`` per layer)
            or ``without_sequence_parallel`` (``sbh(10 + 24/t)`` per layer, bf16 logits and a
            5% overhead factor), used for every other setting.
    """

    weight_and_optimizer: float
    activations: float
    per_layer_activations: float
    branch: str

    @property
    def total(self) -> float:
        return self.weight_and_optimizer + self.activations


MEGATRON_OVERHEAD_FACTOR = 1.05  # the without-SP branch's allowance for temporaries


def megatron_formula(
    shape: ModelShape, layout: Layout, *, distributed_optimizer: bool
) -> MegatronFormula:
    """Megatron-LM's theoretical-memory formula for a dense (non-MoE, non-MLA) GPT.

    A reimplementation for cross-checking :func:`dense_adam_memory`, approximations included:
    biases, q/k norms, post-norms and learned positions are not counted; norm weights are divided
    by tp (they are replicated); the final norm is spread over pipeline stages; token ids are
    divided by tp. Hidden dropout masks are always counted.
    """
    layout.check_fits(shape)
    h, a, g = shape.hidden_size, shape.num_attention_heads, shape.num_query_groups
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    s, b = layout.seq_length, layout.micro_batch_size
    vocab = shape.padded_vocab_size(tp)
    # Parameters.
    norm_size = 1 if shape.normalization == "RMSNorm" else 2
    gated_multiplier = 3 / 2 if shape.gated_mlp else 1
    query_to_hidden = shape.query_width / h
    self_attention = 2 * h * h * ((1 + g / a) * query_to_hidden)
    per_layer_params = 2 * h * (shape.ffn_hidden_size * gated_multiplier + norm_size)
    per_layer_params += self_attention
    embedding = h * vocab
    block = per_layer_params * shape.num_layers + norm_size * h
    most_loaded = (block / pp + embedding) / tp
    if not shape.tied_embeddings and pp == 1:
        most_loaded += embedding / tp
    bytes_per_param = 6 + 12 / dp if distributed_optimizer else 18
    weight_and_optimizer = most_loaded * bytes_per_param
    # Activations.
    sp_selective = layout.sequence_parallel and layout.recompute == "selective"
    if sp_selective:
        per_layer = s * b * h * (18 + 4 * shape.ffn_hidden_size / h)
    else:
        per_layer = s * b * h * (10 + 24 / tp)
    activations = per_layer * shape.num_layers
    activations += 8 * s * b * pp + s * b * h * pp
    if layout.vpp is not None:
        activations *= 1 + (pp - 1) / (pp * layout.vpp)
    elif pp > 1 and layout.num_microbatches is not None:
        activations *= min(1, layout.num_microbatches / pp)
    if sp_selective:
        if pp == 1:
            activations += s * b * h * 4 * (1 + vocab / h)
        activations /= tp
        return MegatronFormula(weight_and_optimizer, activations, per_layer / tp,
                               "sequence_parallel_selective")
    if pp == 1:
        activations += (s * b * vocab / tp + s * b * h) * 2
    activations *= MEGATRON_OVERHEAD_FACTOR
    return MegatronFormula(weight_and_optimizer, activations, per_layer,
                           "without_sequence_parallel")
