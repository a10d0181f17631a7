"""Build a Megatron-Core GPTModel for a run, with layout-independent initialisation.

The model uses Megatron's local layer spec with three substitutions: the four target linears
are the sketch-capable subclasses of Megatron's parallel linears (identical to Megatron's layers
until a sketch is attached), the norms accept sequence parallelism, and core attention is the one
``model.attention`` names (``sdpa``: :class:`SDPAttention`, no ``s x s`` storage; ``local``:
Megatron's ``DotProductAttention``; ``te``: Transformer Engine's fused attention and norms, on GPU).

Initialisation is layout independent by construction: every parameter is drawn as its full TP=1
tensor from a generator seeded by ``(train.seed, global parameter name)`` and this rank's shard
is cut from it. The same seed therefore gives the same full weights for every TP size (and,
because names carry global layer numbers, for every pipeline split).
"""

from __future__ import annotations

import copy
import hashlib
import math

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_logra.config import Config, ModelConfig
from megatron_logra.config.moe import is_moe_layer
from megatron_logra.mcore.models.moe import moe_mlp_spec, moe_transformer_kwargs
from megatron_logra.mcore.models.norms import SequenceParallelTorchNorm
from megatron_logra.mcore.models.sdpa_attention import SDPAttention
from megatron_logra.mcore.models.sharding import (
    full_shape,
    global_named_parameters,
    partition_of,
    shard_from_full,
)
from megatron_logra.mcore.models.te_modules import transformer_engine_modules
from megatron_logra.mcore.process_groups import ParallelGroups
from megatron_logra.mcore.tensor_parallel.sketched_linear import (
    SketchedColumnParallelLinear,
    SketchedRowParallelLinear,
)


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Vocabulary padded to a multiple of ``divisible_by`` (independent of the TP size)."""
    return int(math.ceil(vocab_size / divisible_by) * divisible_by)


def transformer_config(cfg: Config, device: torch.device) -> TransformerConfig:
    """The one written-out mapping from our model/parallel sections to Megatron's config."""
    m: ModelConfig = cfg.model
    params_dtype = torch.bfloat16 if m.params_dtype == "bf16" else torch.float32
    method, recompute_layers = m.full_recompute or (None, None)
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups,
        ffn_hidden_size=m.ffn_hidden_size,
        normalization=m.normalization,
        layernorm_epsilon=m.layernorm_epsilon,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        # Also makes finalize_model_grads sum the q/k norms' gradients over TP (each rank's
        # heads give a partial sum).
        qk_layernorm=m.qk_layernorm,
        gated_linear_unit=m.activation == "swiglu",
        activation_func=F.silu if m.activation == "swiglu" else F.gelu,
        init_method_std=m.init_method_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=params_dtype,
        bf16=m.params_dtype == "bf16",
        tensor_model_parallel_size=cfg.parallel.tp,
        context_parallel_size=cfg.parallel.cp,
        # Transformer Engine's CP attention (model.attention=te); sdpa all-gathers K/V itself.
        cp_comm_type=cfg.parallel.cp_comm_type,
        pipeline_model_parallel_size=cfg.parallel.pp,
        virtual_pipeline_model_parallel_size=cfg.parallel.vpp,
        pipeline_dtype=params_dtype,
        sequence_parallel=cfg.parallel.sp,
        # Sum of per-token losses, normalised once by the global token count in
        # finalize_model_grads: exact under any microbatch / data-parallel split.
        calculate_per_token_loss=True,
        use_cpu_initialization=device.type == "cpu",
        # Fused kernels come from apex / Transformer Engine, which the local spec does not use.
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        # Interleaved pipelining over gloo mismatches batched p2p messages (silently wrong).
        batch_p2p_comm=False,
        recompute_granularity=None if m.recompute == "none" else m.recompute,
        recompute_method=method,
        recompute_num_layers=recompute_layers,
        # Selective recompute covers core attention only: in Megatron 0.16.1 the mlp module's
        # recompute hangs with biases and the layernorm one needs Transformer Engine.
        recompute_modules=["core_attn"],
        **moe_transformer_kwargs(m, cfg.parallel.ep),
    )


def gpt_layer_spec(
    m: ModelConfig, sequence_parallel: bool, layers_per_chunk: int, first_layer: int = 0
) -> ModuleSpec | TransformerBlockSubmodules:
    """Megatron's local GPT layer spec with sketch-capable linears, SP-capable norms and the
    core attention of ``model.attention`` (``te`` also takes Transformer Engine's norms).

    ``layers_per_chunk`` is the number of decoder layers one model chunk builds (a block spec
    lists exactly the layers of its pipeline stage; Megatron numbers them globally), the first
    of them global layer ``first_layer`` (0-based; it decides which of them are MoE layers).
    """
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=m.normalization))
    layer = spec.submodules
    layer.self_attention.submodules.linear_qkv = SketchedColumnParallelLinear
    layer.self_attention.submodules.linear_proj = SketchedRowParallelLinear
    layer.mlp.submodules.linear_fc1 = SketchedColumnParallelLinear
    layer.mlp.submodules.linear_fc2 = SketchedRowParallelLinear
    if m.attention == "te":
        norm, core_attention = transformer_engine_modules()
    else:
        norm = SequenceParallelTorchNorm
        core_attention = SDPAttention if m.attention == "sdpa" else DotProductAttention
    layer.self_attention.submodules.core_attention = core_attention
    layer.input_layernorm = norm
    layer.pre_mlp_layernorm = norm
    if m.qk_layernorm:
        layer.self_attention.submodules.q_layernorm = norm
        layer.self_attention.submodules.k_layernorm = norm
    if m.num_moe_experts is not None:
        # Megatron's MoE layer (router, dispatcher, sketch-capable SequentialMLP experts) in
        # every model.moe_layer_freq-th *global* layer: the chunk's layers are first_layer on.
        moe_spec = copy.deepcopy(spec)
        moe_spec.submodules.mlp = moe_mlp_spec()
        layer_specs = [moe_spec if is_moe_layer(m, first_layer + i) else spec
                       for i in range(layers_per_chunk)]
        return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=norm)
    if not sequence_parallel and m.attention != "te":
        return spec
    # The final norm is chosen by the block spec; pass it explicitly so it is SP-capable too
    # (and Transformer Engine's with te).
    return TransformerBlockSubmodules(layer_specs=[spec] * layers_per_chunk, layer_norm=norm)


def build_model_chunks(
    cfg: Config, groups: ParallelGroups, vocab_size: int
) -> list[torch.nn.Module]:
    """This rank's model chunks: one per virtual pipeline stage (one without interleaving).

    All chunks share one TransformerConfig object, as Megatron's schedules expect (they read
    the finalize/sync hooks from the first chunk's config).
    """
    m = cfg.model
    if m.attention == "te" and groups.device.type != "cuda":
        raise ValueError(
            f"model.attention=te runs Transformer Engine's GPU kernels, but this run is on "
            f"{groups.device.type}; use model.attention=sdpa (or local) here"
        )
    config = transformer_config(cfg, groups.device)
    chunks = []
    for chunk in range(groups.vpp_size):
        model = GPTModel(
            config=config,
            transformer_layer_spec=gpt_layer_spec(
                m, cfg.parallel.sp, m.num_layers // (groups.pp_size * groups.vpp_size),
                # Megatron's own offset of this chunk's first layer (0-based).
                get_transformer_layer_offset(config, chunk if groups.vpp_size > 1 else None,
                                             groups.pp_rank),
            ),
            vocab_size=padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by),
            max_sequence_length=m.seq_length,
            pre_process=groups.is_first_stage(chunk),
            post_process=groups.is_last_stage(chunk),
            parallel_output=True,
            share_embeddings_and_output_weights=not m.untie_embeddings,
            position_embedding_type=m.position_embedding,
            rotary_base=m.rotary_base,
            vp_stage=chunk if groups.vpp_size > 1 else None,
        )
        model.to(groups.device)
        initialize_layout_invariant_(model, m, seed=cfg.train.seed, groups=groups)
        if config.bf16:
            # Megatron's mixed-precision wrapper: bf16 inputs on the first stage, fp32 outputs
            # (losses) on the last.
            model = Float16Module(config, model)
        chunks.append(model)
    return chunks


def build_model(cfg: Config, groups: ParallelGroups, vocab_size: int) -> torch.nn.Module:
    """The single model chunk of a run without virtual pipeline stages."""
    if groups.vpp_size != 1:
        raise ValueError("build_model builds one chunk; use build_model_chunks with parallel.vpp")
    return build_model_chunks(cfg, groups, vocab_size)[0]


def _init_rule(name: str, m: ModelConfig) -> tuple[str, float]:
    """``(kind, std)`` for a parameter's global name: normal(0, std), ones or zeros."""
    if name.endswith(".bias"):
        return "zeros", 0.0
    if "layernorm" in name or name.endswith("final_layernorm.weight"):
        return "ones", 0.0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        # Megatron's scaled init for the two linears that write into the residual stream.
        return "normal", m.init_method_std / math.sqrt(2.0 * m.num_layers)
    if name.endswith(
        ("router.weight", "shared_experts.gate_weight", "linear_qkv.weight",
         "linear_fc1.weight", "word_embeddings.weight",
         "position_embeddings.weight", "output_layer.weight")
    ):
        return "normal", m.init_method_std
    raise RuntimeError(f"no initialisation rule for parameter {name!r}")


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"megatron_logra.init|{seed}|{name}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & (2**63 - 1)


@torch.no_grad()
def initialize_layout_invariant_(
    model: torch.nn.Module, m: ModelConfig, *, seed: int, groups: ParallelGroups
) -> None:
    """Overwrite every parameter with its shard of a full tensor seeded by its global name."""
    for name, param in global_named_parameters(model):
        if name == "output_layer.weight" and not m.untie_embeddings:
            # With tied embeddings and several pipeline stages, the last stage holds its own
            # copy of the word embeddings as output_layer.weight; it must start equal to them.
            name = "embedding.word_embeddings.weight"
        kind, std = _init_rule(name, m)
        if kind == "zeros":
            param.zero_()
            continue
        if kind == "ones":
            param.fill_(1.0)
            continue
        generator = torch.Generator(device="cpu").manual_seed(_name_seed(seed, name))
        full = torch.empty(full_shape(param, groups.tp_size), dtype=torch.float32)
        full.normal_(0.0, std, generator=generator)
        dim, stride = partition_of(param)
        shard = shard_from_full(full, dim, stride, groups.tp_rank, groups.tp_size)
        param.copy_(shard.to(device=param.device, dtype=param.dtype))
