"""The ``model`` and ``parallel`` sections: what GPT is built, and on which layout."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_logra.config.checks import check_choice, check_positive
from megatron_logra.config.moe import check_moe_model

NORMALIZATIONS: tuple[str, ...] = ("LayerNorm", "RMSNorm")
ACTIVATIONS: tuple[str, ...] = ("gelu", "swiglu")
POSITION_EMBEDDINGS: tuple[str, ...] = ("rope", "learned_absolute")
PARAMS_DTYPES: tuple[str, ...] = ("fp32", "bf16")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
ATTENTIONS: tuple[str, ...] = ("sdpa", "local", "te")
RECOMPUTES: tuple[str, ...] = ("none", "selective", "full")
RECOMPUTE_METHODS: tuple[str, ...] = ("uniform", "block")
CP_COMM_TYPES: tuple[str, ...] = ("p2p", "all_gather", "a2a")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A GPT built from Megatron-Core's layer spec with our sketch-capable linears."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    """Grouped-query attention groups; None means multi-head attention (= num_attention_heads)."""
    ffn_hidden_size: int = 256
    seq_length: int = 64
    normalization: str = "LayerNorm"
    activation: str = "gelu"
    """``gelu``, or ``swiglu`` (gated fc1, as in Llama and Qwen)."""
    position_embedding: str = "rope"
    rotary_base: int = 10000
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    """Normalise every query and key head over its head width before the rotary embedding
    (Megatron's q_layernorm / k_layernorm, ``model.normalization`` kind; Qwen3's q_norm /
    k_norm). Their weights are trained by the native optimizer, as the other norms."""
    untie_embeddings: bool = True
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    vocab_size: int | None = None
    """Rows of the word embedding before padding; None takes the tokenizer's vocabulary. Set it
    to the checkpoint's row count when that exceeds the tokenizer (Qwen2.5: 151936 rows for
    151665 tokens); ids the tokenizer cannot produce are never sampled."""
    make_vocab_size_divisible_by: int = 128
    """The tokenizer's vocabulary is padded to a multiple of this, independent of TP size, so
    that every parallel layout builds the same model."""
    params_dtype: str = "fp32"
    """``fp32``, or ``bf16`` (Megatron's mixed precision: bf16 weights and compute, fp32 main
    gradients and optimizer state)."""
    attention: str = "sdpa"
    """Core attention: ``sdpa`` (torch's scaled_dot_product_attention: fused flash /
    memory-efficient kernels, no ``s x s`` storage), ``local`` (Megatron's DotProductAttention,
    which keeps ``[b, heads/tp, s, s]`` probabilities per layer) or ``te`` (Transformer Engine's
    fused attention and norms; GPU with Transformer Engine installed)."""
    recompute: str = "none"
    """Activation recompute: ``none``; ``selective`` (core attention only: its inputs are kept
    and it is recomputed in backward; removes the ``s x s`` probabilities of ``local``, little
    with ``sdpa``); ``full`` (whole layers, Megatron's ``recompute_method``)."""
    recompute_method: str | None = None
    """With ``recompute=full``: ``uniform`` (checkpoint every group of ``recompute_num_layers``
    layers; only the groups' inputs are kept) or ``block`` (recompute the first
    ``recompute_num_layers`` layers of each pipeline stage, keep the rest). Default uniform."""
    recompute_num_layers: int | None = None
    """With ``recompute=full``: layers per group (uniform) or per stage (block). Default 1."""
    # -- mixture of experts (megatron_logra.config.moe validates these; docs/moe.md)
    num_moe_experts: int | None = None
    """Routed experts per MoE layer; None builds a dense GPT (every other moe_* key must then
    stay unset)."""
    moe_router_topk: int = 2
    """Experts each token is routed to (Megatron's top-k router, softmax scores)."""
    moe_ffn_hidden_size: int | None = None
    """FFN width of one routed expert; None takes model.ffn_hidden_size."""
    moe_shared_expert_ffn_hidden_size: int | None = None
    """FFN width of the shared expert every token also passes (Qwen2-MoE style); None: none."""
    moe_router_pre_softmax: bool = False
    """Routing probabilities from a softmax over all experts' logits, the top k kept as they
    are (Megatron's moe_router_pre_softmax; Hugging Face's norm_topk_prob=false, Qwen2-MoE);
    false: a softmax over the top k logits (norm_topk_prob=true, Qwen3-MoE)."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output per token by ``sigmoid(x w)``, ``w [1, hidden]`` a
    native-optimizer parameter (Megatron's moe_shared_expert_gate; Qwen2-MoE)."""
    moe_layer_freq: int = 1
    """Every k-th decoder layer is MoE (layers 0, k, 2k, ...); the others keep the dense MLP."""
    moe_token_dispatcher: str = "alltoall"
    """Megatron's token dispatcher over the expert-parallel group: ``alltoall`` or
    ``allgather`` (both run over gloo on CPU)."""
    init_checkpoint: str | None = None
    """Start from the weights of this checkpoint directory (model-only, e.g. a converted Hugging
    Face model or a warm start, or a training checkpoint) instead of random initialisation. Any
    parallel layout loads it. Ignored when resuming from checkpoint.dir."""

    def validate(self, path: str = "model") -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "seq_length", "rotary_base", "make_vocab_size_divisible_by"):
            check_positive(f"{path}.{name}", getattr(self, name))
        if self.vocab_size is not None:
            check_positive(f"{path}.vocab_size", self.vocab_size)
        check_positive(f"{path}.init_method_std", self.init_method_std)
        check_positive(f"{path}.layernorm_epsilon", self.layernorm_epsilon)
        check_choice(f"{path}.normalization", self.normalization, NORMALIZATIONS)
        check_choice(f"{path}.activation", self.activation, ACTIVATIONS)
        check_choice(f"{path}.position_embedding", self.position_embedding, POSITION_EMBEDDINGS)
        check_choice(f"{path}.params_dtype", self.params_dtype, PARAMS_DTYPES)
        check_choice(f"{path}.attention", self.attention, ATTENTIONS)
        check_choice(f"{path}.recompute", self.recompute, RECOMPUTES)
        self._check_recompute(path)
        check_moe_model(self, path)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{path}.hidden_size={self.hidden_size} must be divisible by "
                f"{path}.num_attention_heads={self.num_attention_heads}"
            )
        if self.num_query_groups is not None:
            check_positive(f"{path}.num_query_groups", self.num_query_groups)
            if self.num_attention_heads % self.num_query_groups:
                raise ValueError(
                    f"{path}.num_attention_heads={self.num_attention_heads} must be divisible by "
                    f"{path}.num_query_groups={self.num_query_groups}"
                )

    def _check_recompute(self, path: str) -> None:
        if self.recompute != "full":
            for name in ("recompute_method", "recompute_num_layers"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{path}.{name}={getattr(self, name)!r} only acts with "
                        f"{path}.recompute=full, not {self.recompute!r}; drop it or set "
                        f"{path}.recompute=full"
                    )
            return
        if self.recompute_method is not None:
            check_choice(f"{path}.recompute_method", self.recompute_method, RECOMPUTE_METHODS)
        if self.recompute_num_layers is not None:
            check_positive(f"{path}.recompute_num_layers", self.recompute_num_layers)

    @property
    def full_recompute(self) -> tuple[str, int] | None:
        """``(method, layers)`` of full recompute, defaults filled in; None without it."""
        if self.recompute != "full":
            return None
        return self.recompute_method or "uniform", self.recompute_num_layers or 1

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def target_widths(self) -> dict[str, tuple[int, int]]:
        """``(output rows, input columns)`` of each target linear's full (TP=1) weight."""
        head_dim = self.hidden_size // self.num_attention_heads
        # An MoE model's MLP linears come in up to three widths (dense MLP, routed expert,
        # shared expert): the narrowest bounds a sketch.
        ffn = min(w for w in (self.ffn_hidden_size, self.moe_ffn_hidden_size,
                              self.moe_shared_expert_ffn_hidden_size) if w is not None)
        fc1_rows = ffn * (2 if self.activation == "swiglu" else 1)
        return {
            "linear_qkv": ((self.num_attention_heads + 2 * self.query_groups) * head_dim,
                           self.hidden_size),
            "linear_proj": (self.hidden_size, self.num_attention_heads * head_dim),
            "linear_fc1": (fc1_rows, self.hidden_size),
            "linear_fc2": (self.hidden_size, ffn),
        }


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The parallel layout. ``dp`` follows from the world size: world = tp * cp * pp * dp."""

    tp: int = 1
    cp: int = 1
    """Context parallelism: each sequence is split over ``cp`` ranks in ``2 * cp`` chunks
    (Megatron's load-balanced causal split); weights are replicated over them, gradients and
    sketches reduced over DP x CP (megatron_logra.config.context_parallel checks the rest)."""
    cp_comm_type: str | None = None
    """Transformer Engine's context-parallel attention (``model.attention=te``): ``p2p``
    (TE's default), ``all_gather`` or ``a2a``. The ``sdpa`` attention always all-gathers the
    keys and values over the CP group."""
    pp: int = 1
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B); None for the plain 1F1B schedule."""
    sp: bool = False
    """Sequence parallelism (needs tp > 1)."""
    dp: int | None = None
    """Derived from the world size; set it only to assert the layout you expect."""
    ep: int = 1
    """Expert parallelism: each MoE layer's experts are split over ``ep`` ranks carved out of
    the data-parallel ones (needs model.num_moe_experts; ep divides dp and the expert count)."""
    device: str = "auto"
    """``cpu`` runs over gloo with the CPU compatibility layer; ``cuda`` over NCCL; ``auto`` picks
    cuda when a GPU is visible."""
    collective_timeout_s: float = 600.0
    """How long a rank waits in one collective (and at start-up, for the others to join) before
    it fails with an error instead of hanging: when another rank died (killed, out of memory, a
    lost node), the survivors stop within about this time. It must exceed the longest legitimate
    wait, e.g. rank 0 writing a checkpoint or grading rewards while the others wait for it."""

    def validate(self, path: str = "parallel") -> None:
        check_positive(f"{path}.tp", self.tp)
        check_positive(f"{path}.cp", self.cp)
        if self.cp_comm_type is not None:
            check_choice(f"{path}.cp_comm_type", self.cp_comm_type, CP_COMM_TYPES)
        check_positive(f"{path}.collective_timeout_s", self.collective_timeout_s)
        check_positive(f"{path}.pp", self.pp)
        check_positive(f"{path}.ep", self.ep)
        check_choice(f"{path}.device", self.device, DEVICES)
        if self.vpp is not None:
            check_positive(f"{path}.vpp", self.vpp)
            if self.pp == 1:
                raise ValueError(
                    f"{path}.vpp={self.vpp} needs {path}.pp > 1 (virtual stages interleave "
                    f"pipeline stages); drop {path}.vpp or raise {path}.pp"
                )
        if self.sp and self.tp == 1:
            raise ValueError(
                f"{path}.sp=true needs {path}.tp > 1 (sequence parallelism splits the "
                f"sequence over the tensor-parallel group); set {path}.sp=false or raise "
                f"{path}.tp"
            )
        if self.dp is not None:
            check_positive(f"{path}.dp", self.dp)
