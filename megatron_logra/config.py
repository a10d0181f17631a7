"""Run configuration: small typed sections, loaded from YAML plus ``key=value`` overrides.

Validation has no side effects and happens before any process group exists, so a typo costs a
second, not a cluster allocation. Every error names the field, the value and what to do.

    cfg = load_config("configs/demo_cpu.yaml", ["parallel.tp=2", "optimizer.name=logra"])
    cfg = cfg.resolved(world_size=2)   # fills parallel.dp and checks the layout
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_logra.controller import KLControlSettings
from megatron_logra.direction import DIRECTIONS
from megatron_logra.projection import DISTRIBUTIONS

TARGET_NAMES: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
OPTIMIZERS: tuple[str, ...] = ("logra", "adam", "sgd", "lora")
NATIVE_OPTIMIZERS: tuple[str, ...] = ("adam", "sgd")
LOGRA_MODES: tuple[str, ...] = ("library", "paper")
UPDATE_FACTOR_DTYPES: tuple[str, ...] = ("bf16", "fp32")
NORMALIZATIONS: tuple[str, ...] = ("LayerNorm", "RMSNorm")
ACTIVATIONS: tuple[str, ...] = ("gelu", "swiglu")
POSITION_EMBEDDINGS: tuple[str, ...] = ("rope", "learned_absolute")
LR_DECAY_STYLES: tuple[str, ...] = ("constant", "linear", "cosine")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
PARAMS_DTYPES: tuple[str, ...] = ("fp32", "bf16")
MASTER_WEIGHTS: tuple[str, ...] = ("auto", "none", "dp_sharded")


def _check_choice(section: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{section}.{name}={value!r} is not valid; choose one of {list(choices)}")


def _check_positive(section: str, name: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{section}.{name}={value!r} must be {bound}")


@dataclass(kw_only=True)
class ModelConfig:
    """A GPT built from Megatron-Core's local (non-Transformer-Engine) layer spec."""

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
    init_checkpoint: str | None = None
    """Start from the weights of this checkpoint directory (model-only, e.g. a converted Hugging
    Face model or a warm start, or a training checkpoint) instead of random initialisation. Any
    parallel layout loads it. Ignored when resuming from checkpoint.dir."""

    def validate(self) -> None:
        s = "model"
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "seq_length", "rotary_base", "make_vocab_size_divisible_by"):
            _check_positive(s, name, getattr(self, name))
        if self.vocab_size is not None:
            _check_positive(s, "vocab_size", self.vocab_size)
        _check_positive(s, "init_method_std", self.init_method_std)
        _check_positive(s, "layernorm_epsilon", self.layernorm_epsilon)
        _check_choice(s, "normalization", self.normalization, NORMALIZATIONS)
        _check_choice(s, "activation", self.activation, ACTIVATIONS)
        _check_choice(s, "position_embedding", self.position_embedding, POSITION_EMBEDDINGS)
        _check_choice(s, "params_dtype", self.params_dtype, PARAMS_DTYPES)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} must be divisible by "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if self.num_query_groups is not None:
            _check_positive(s, "num_query_groups", self.num_query_groups)
            if self.num_attention_heads % self.num_query_groups:
                raise ValueError(
                    f"model.num_attention_heads={self.num_attention_heads} must be divisible by "
                    f"model.num_query_groups={self.num_query_groups}"
                )

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads


@dataclass(kw_only=True)
class ParallelConfig:
    """The parallel layout. ``dp`` follows from the world size: world = tp * pp * dp."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B); None for the plain 1F1B schedule."""
    sp: bool = False
    """Sequence parallelism (needs tp > 1)."""
    dp: int | None = None
    """Derived from the world size; set it only to assert the layout you expect."""
    device: str = "auto"
    """``cpu`` runs over gloo with the CPU compatibility layer; ``cuda`` over NCCL; ``auto`` picks
    cuda when a GPU is visible."""

    def validate(self) -> None:
        _check_positive("parallel", "tp", self.tp)
        _check_positive("parallel", "pp", self.pp)
        _check_choice("parallel", "device", self.device, DEVICES)
        if self.vpp is not None:
            _check_positive("parallel", "vpp", self.vpp)
            if self.pp == 1:
                raise ValueError(
                    f"parallel.vpp={self.vpp} needs parallel.pp > 1 (virtual stages interleave "
                    "pipeline stages); drop parallel.vpp or raise parallel.pp"
                )
        if self.sp and self.tp == 1:
            raise ValueError(
                "parallel.sp=true needs parallel.tp > 1 (sequence parallelism splits the "
                "sequence over the tensor-parallel group); set parallel.sp=false or raise "
                "parallel.tp"
            )
        if self.dp is not None:
            _check_positive("parallel", "dp", self.dp)


@dataclass(kw_only=True)
class OptimizerConfig:
    """What trains the model. ``logra`` sketches the target linears and hands every other
    parameter to Megatron's own optimizer (``logra.native_optimizer``)."""

    name: str = "adam"
    lr: float = 1e-3
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables). For LoGRA the norm counts each sketch as the
    reconstructed gradient ``S A``."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer (ZeRO-1 style sharded fp32 state over DP)."""

    def validate(self) -> None:
        s = "optimizer"
        _check_choice(s, "name", self.name, OPTIMIZERS)
        _check_choice(s, "lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES)
        _check_positive(s, "lr", self.lr)
        _check_positive(s, "min_lr", self.min_lr, allow_zero=True)
        if self.min_lr > self.lr:
            raise ValueError(f"optimizer.min_lr={self.min_lr} must not exceed optimizer.lr={self.lr}")
        _check_positive(s, "lr_warmup_steps", self.lr_warmup_steps, allow_zero=True)
        _check_positive(s, "weight_decay", self.weight_decay, allow_zero=True)
        _check_positive(s, "clip_grad", self.clip_grad, allow_zero=True)
        for name in ("adam_beta1", "adam_beta2", "sgd_momentum"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"optimizer.{name}={value} must be in [0, 1)")
        _check_positive(s, "adam_eps", self.adam_eps)


@dataclass(kw_only=True)
class LoGRAConfig:
    """Low-rank gradient sketches on the target linears (used when optimizer.name=logra)."""

    mode: str = "library"
    """``library``: RowAdam direction, lr schedule, clipping, non-targets trained natively.
    ``paper``: the paper's RowAdam, a global update ratio instead of a learning rate, no
    clipping, every non-target parameter frozen (use with logra.kl_control=true)."""
    sketch_rank: int = 16
    distribution: str = "rademacher"
    """``rademacher``, ``gaussian``, or ``identity`` (A = I, sketch rank = input width: the
    dense-gradient limit, for tests)."""
    direction: str = "auto"
    """``row_adam`` (library), ``paper_row_adam`` (the paper's), ``sgd`` (D = S), or ``auto``:
    the mode's own (row_adam in library mode, paper_row_adam in paper mode)."""
    native_optimizer: str = "adam"
    """Megatron optimizer for every parameter that is not a sketched target."""
    seed: int = 42
    refresh: bool = True
    """Redraw the projections after every update (with false, A never changes)."""
    master_weights: str = "auto"
    """Precision of the sketched weights' updates: ``none`` (fp32 weights are their own masters),
    ``dp_sharded`` (bf16 weights, fp32 master rows sharded over data parallelism), ``auto``
    (picked from model.params_dtype)."""
    beta2: float = 0.95
    eps: float = 1e-8
    targets: list[str] = field(default_factory=lambda: list(TARGET_NAMES))
    update_ratio: float = 6e-5
    """Paper mode: the proposed update's global Frobenius norm, relative to the target weights'
    (before the KL controller's scale). The paper's 6e-5 is for billion-parameter models; tiny
    CPU models need ~1e-3 (see docs/LOG.md)."""
    update_factor_dtype: str = "bf16"
    """Paper mode: the scaled factor alpha * D is rounded to this dtype before the merge, as
    the paper's runs do (``bf16``), or kept in ``fp32``."""
    kl_control: bool = False
    """Scale each update to the predicted-KL budget of the kl_control section."""

    @property
    def resolved_direction(self) -> str:
        if self.direction != "auto":
            return self.direction
        return "paper_row_adam" if self.mode == "paper" else "row_adam"

    def validate(self) -> None:
        s = "logra"
        _check_choice(s, "mode", self.mode, LOGRA_MODES)
        _check_choice(s, "distribution", self.distribution, DISTRIBUTIONS)
        _check_choice(s, "direction", self.direction, ("auto", *DIRECTIONS))
        _check_choice(s, "update_factor_dtype", self.update_factor_dtype, UPDATE_FACTOR_DTYPES)
        _check_positive(s, "update_ratio", self.update_ratio)
        _check_choice(s, "native_optimizer", self.native_optimizer, NATIVE_OPTIMIZERS)
        _check_choice(s, "master_weights", self.master_weights, MASTER_WEIGHTS)
        _check_positive(s, "sketch_rank", self.sketch_rank)
        _check_positive(s, "seed", self.seed, allow_zero=True)
        if not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"logra.beta2={self.beta2} must be in [0, 1)")
        _check_positive(s, "eps", self.eps)
        _check_targets(s, self.targets)


def _check_targets(section: str, targets: list[str]) -> None:
    if not targets:
        raise ValueError(f"{section}.targets is empty; choose from {list(TARGET_NAMES)}")
    for name in targets:
        if name not in TARGET_NAMES:
            raise ValueError(
                f"{section}.targets contains {name!r}; valid targets are {list(TARGET_NAMES)}"
            )
    if len(set(targets)) != len(targets):
        raise ValueError(f"{section}.targets has duplicates: {targets}")


@dataclass(kw_only=True)
class LoRAConfig:
    """LoRA adapters on the target linears (optimizer.name=lora), trained with Adam under the
    optimizer section's settings: the memory baseline LoGRA is compared with."""

    rank: int = 16
    alpha: float = 32.0
    """The adapter output is scaled by alpha / rank."""
    seed: int = 0
    """Seeds the down projections A (B starts at zero), the same at every TP size."""
    targets: list[str] = field(default_factory=lambda: list(TARGET_NAMES))

    def validate(self) -> None:
        _check_positive("lora", "rank", self.rank)
        _check_positive("lora", "alpha", self.alpha)
        _check_positive("lora", "seed", self.seed, allow_zero=True)
        _check_targets("lora", self.targets)


_KL_DEFAULTS = KLControlSettings()


@dataclass(kw_only=True)
class KLControlConfig:
    """Predicted-KL step control (used when logra.kl_control=true); defaults are the paper's.
    See megatron_logra.controller for the rule."""

    kl_budget: float = _KL_DEFAULTS.kl_budget
    """Per-token KL budget (nats) at the first update."""
    kl_budget_final: float = _KL_DEFAULTS.kl_budget_final
    schedule_steps: int = _KL_DEFAULTS.schedule_steps
    """Updates over which the budget anneals (cosine) from kl_budget to kl_budget_final."""
    alpha_max: float = _KL_DEFAULTS.alpha_max
    mismatch_subtraction: bool = _KL_DEFAULTS.mismatch_subtraction
    mismatch_ema_weight: float = _KL_DEFAULTS.mismatch_ema_weight
    mismatch_budget_floor: float = _KL_DEFAULTS.mismatch_budget_floor
    probe_responses: int = _KL_DEFAULTS.probe_responses
    """The first this-many sequences of the global batch are the probe set (on whichever
    data-parallel ranks hold them), so alpha does not depend on the data-parallel size."""
    probe_max_tokens: int = _KL_DEFAULTS.probe_max_tokens
    temperature: float = 1.0
    """Sampling temperature of the policy (the KL is between temperature-scaled softmaxes)."""
    mismatch_input: float | None = None
    """Supervised runs only: a rollout/trainer log-prob gap to feed the controller each step
    (RL runs measure it from the rollouts)."""

    def settings(self) -> KLControlSettings:
        names = {f.name for f in dataclasses.fields(KLControlSettings)}
        return KLControlSettings(**{k: v for k, v in dataclasses.asdict(self).items()
                                    if k in names})

    def validate(self) -> None:
        try:
            self.settings()
        except ValueError as error:
            raise ValueError(f"kl_control.{error}") from error
        _check_positive("kl_control", "temperature", self.temperature)


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 20
    micro_batch_size: int = 4
    global_batch_size: int = 8
    """Sequences per optimizer step over all data-parallel ranks."""
    seed: int = 1234
    """Seeds model initialisation and data order (not the projections: logra.seed)."""
    exit_interval: int = 0
    """Stop (after checkpointing, when checkpoint.dir is set) once this many steps ran in this
    invocation, e.g. to fit a job into a scheduler's time slot; 0 runs to train.steps."""

    def validate(self) -> None:
        for name in ("steps", "micro_batch_size", "global_batch_size"):
            _check_positive("train", name, getattr(self, name))
        _check_positive("train", "seed", self.seed, allow_zero=True)
        _check_positive("train", "exit_interval", self.exit_interval, allow_zero=True)


DATA_FORMATS: tuple[str, ...] = ("corpus", "prompts")


@dataclass(kw_only=True)
class DataConfig:
    dir: str = ".data/synthetic"
    """A directory made by ``tools/make_synthetic_data.py``: tokens.npy (corpus), train.jsonl /
    eval.jsonl (prompts and answers) and tokenizer.model."""
    format: str = "corpus"
    """``corpus``: language modelling on tokens.npy; ``prompts``: supervised prompt -> answer
    training on train.jsonl (the loss on the answer and EOS only)."""
    tokenizer: str | None = None
    """A local Hugging Face tokenizer directory (e.g. the ``tokenizer/`` that
    ``tools/convert_hf.py to-megatron`` writes) to encode train.jsonl / eval.jsonl with, in place
    of data.dir's tokenizer.model. Prompt data only: the corpus of ``format: corpus`` is stored
    already tokenized."""

    def validate(self) -> None:
        if not self.dir:
            raise ValueError("data.dir is empty; point it at a directory made by "
                             "tools/make_synthetic_data.py")
        _check_choice("data", "format", self.format, DATA_FORMATS)
        if self.tokenizer is not None and not self.tokenizer:
            raise ValueError("data.tokenizer is empty; point it at a Hugging Face tokenizer "
                             "directory or leave it unset to use data.dir's tokenizer.model")
        if self.tokenizer is not None and self.format != "prompts":
            raise ValueError(
                f"data.tokenizer={self.tokenizer!r} needs data.format=prompts (got "
                f"{self.format!r}): the corpus is stored already tokenized by data.dir's "
                "tokenizer; drop data.tokenizer or train on prompt data"
            )


@dataclass(kw_only=True)
class RunConfig:
    dir: str = "runs/default"
    """Where metrics.jsonl, the resolved config and run summaries are written."""
    save_full_weights: bool = False
    """Gather the full (unsharded) weights at the end into ``<run.dir>/full_weights.pt``, keyed by
    layout-independent names; used to compare runs across parallel layouts."""
    save_model: bool = False
    """Write a model-only checkpoint of the final weights to ``<run.dir>/model`` (what
    model.init_checkpoint of a later run loads, e.g. a warm start for RL)."""
    tensorboard: bool = False
    """Mirror the metrics to TensorBoard event files in ``<run.dir>/tensorboard``."""
    wandb: str = "off"
    """Mirror the metrics to Weights & Biases: ``off``, ``offline`` (files under run.dir) or
    ``online``."""
    wandb_project: str = "megatron-logra"

    def validate(self) -> None:
        if not self.dir:
            raise ValueError("run.dir is empty; give the run a directory")
        _check_choice("run", "wandb", self.wandb, ("off", "offline", "online"))


RL_LOSSES: tuple[str, ...] = ("paper", "grpo")
REWARDS: tuple[str, ...] = ("exact_match", "math_verify")


@dataclass(kw_only=True)
class RLConfig:
    """Reinforcement learning on prompt/answer data (``megatron-logra rl``)."""

    loss: str = "paper"
    """``paper``: REINFORCE with a running baseline, failure reward, length weighting and a
    detached truncated importance weight; ``grpo``: group-normalised advantages over
    samples_per_prompt responses, clipped ratio, optional k3 reference KL."""
    prompts_per_step: int = 16
    """Prompts in each step's global batch."""
    samples_per_prompt: int = 1
    """Responses per prompt (a GRPO group); the training batch is prompts x samples."""
    max_new_tokens: int = 8
    temperature: float = 1.0
    """Sampling temperature of the rollouts (also the KL controller's)."""
    top_p: float = 1.0
    reward: str = "exact_match"
    """``exact_match`` (the synthetic arithmetic task) or ``math_verify`` (math answers)."""
    seed: int = 0
    """Seeds the prompt order and the sampling (counter-based: layout independent)."""
    failure_reward: float = -0.01
    running_baseline_weight: float = 0.1
    response_length_reference: float | None = 1024.0
    """Paper preset: advantages are weighted by L_ref / L_i (None disables)."""
    importance_weight_cap: float = 2.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_beta: float = 0.0
    """GRPO: weight of the k3 KL to the initial policy (0: no reference model is kept)."""
    eval_interval: int = 10
    """Evaluate on held-out prompts every this many steps (and before and after training)."""
    eval_prompts: int = 200
    eval_samples: int = 4
    """Samples per held-out prompt: pass@1 averages them, pass@k uses all k of them."""
    eval_temperature: float = 1.0
    eval_top_p: float = 1.0

    @property
    def global_batch(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    def validate(self) -> None:
        s = "rl"
        _check_choice(s, "loss", self.loss, RL_LOSSES)
        _check_choice(s, "reward", self.reward, REWARDS)
        for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens",
                     "eval_prompts", "eval_samples"):
            _check_positive(s, name, getattr(self, name))
        for name in ("temperature", "eval_temperature", "importance_weight_cap"):
            _check_positive(s, name, getattr(self, name))
        _check_positive(s, "eval_interval", self.eval_interval, allow_zero=True)
        _check_positive(s, "seed", self.seed, allow_zero=True)
        _check_positive(s, "kl_beta", self.kl_beta, allow_zero=True)
        for name in ("top_p", "eval_top_p", "running_baseline_weight"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"rl.{name}={value} must be in (0, 1]")
        if self.loss == "grpo" and self.samples_per_prompt < 2:
            raise ValueError(
                f"rl.loss=grpo normalises rewards within a prompt's responses; "
                f"rl.samples_per_prompt={self.samples_per_prompt} must be >= 2"
            )
        if self.response_length_reference is not None:
            _check_positive(s, "response_length_reference", self.response_length_reference)


@dataclass(kw_only=True)
class CheckpointConfig:
    """Distributed checkpoints (reshardable across TP/PP/DP layouts, written atomically)."""

    dir: str | None = None
    """Directory of the run's checkpoints; None disables checkpointing."""
    interval: int = 0
    """Save every this many steps (0: only at the end of training and on SIGTERM)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in ``dir`` (start fresh if there is none)."""
    verify: bool = True
    """Check every checkpoint file's size and SHA-256 against the manifest before loading."""

    def validate(self) -> None:
        _check_positive("checkpoint", "interval", self.interval, allow_zero=True)
        if self.dir is None and (self.resume or self.interval):
            raise ValueError(
                "checkpoint.resume / checkpoint.interval need checkpoint.dir; set "
                "checkpoint.dir=<directory>"
            )


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    logra: LoGRAConfig = field(default_factory=LoGRAConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    kl_control: KLControlConfig = field(default_factory=KLControlConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self) -> None:
        for section in dataclasses.fields(self):
            getattr(self, section.name).validate()
        m, p = self.model, self.parallel
        for name, value in (
            ("model.num_attention_heads", m.num_attention_heads),
            ("model.num_query_groups", m.query_groups),
            ("model.ffn_hidden_size", m.ffn_hidden_size),
            ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
        ):
            if value % p.tp:
                raise ValueError(
                    f"{name}={value} must be divisible by parallel.tp={p.tp}; change one of them"
                )
        if self.logra.kl_control and self.optimizer.name != "logra":
            raise ValueError(
                "logra.kl_control=true controls LoGRA updates; it needs optimizer.name=logra"
            )
        master = self.logra.master_weights
        if (master, m.params_dtype) in (("none", "bf16"), ("dp_sharded", "fp32")):
            raise ValueError(
                f"logra.master_weights={master} does not fit model.params_dtype={m.params_dtype}: "
                "fp32 weights are their own masters (none), bf16 weights need fp32 masters "
                "(dp_sharded); use logra.master_weights=auto"
            )
        stages = p.pp * (p.vpp or 1)
        if m.num_layers % stages:
            raise ValueError(
                f"model.num_layers={m.num_layers} must be divisible by parallel.pp * "
                f"parallel.vpp = {stages} (every pipeline stage holds the same number of layers)"
            )
        if p.sp and m.seq_length % p.tp:
            raise ValueError(
                f"model.seq_length={m.seq_length} must be divisible by parallel.tp={p.tp} "
                "with sequence parallelism"
            )

    def resolved(self, world_size: int) -> Config:
        """A copy with ``parallel.dp`` filled in from the world size, with the batch checked."""
        self.validate()
        p, t = self.parallel, self.train
        model_parallel = p.tp * p.pp
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tp * parallel.pp = "
                f"{model_parallel}; launch a multiple of {model_parallel} processes"
            )
        dp = world_size // model_parallel
        if p.dp is not None and p.dp != dp:
            raise ValueError(
                f"parallel.dp={p.dp} but world size {world_size} with tp={p.tp}, pp={p.pp} "
                f"gives dp={dp}; drop parallel.dp or launch {p.dp * model_parallel} processes"
            )
        if t.global_batch_size % (t.micro_batch_size * dp):
            raise ValueError(
                f"train.global_batch_size={t.global_batch_size} must be a multiple of "
                f"train.micro_batch_size * dp = {t.micro_batch_size} * {dp}"
            )
        microbatches = t.global_batch_size // (t.micro_batch_size * dp)
        if p.vpp is not None and microbatches % p.pp:
            raise ValueError(
                f"the interleaved schedule needs the number of microbatches per step "
                f"({microbatches} = train.global_batch_size / (train.micro_batch_size * dp)) to "
                f"be a multiple of parallel.pp={p.pp}; change the batch sizes"
            )
        return dataclasses.replace(self, parallel=dataclasses.replace(p, dp=dp))

    @property
    def num_microbatches(self) -> int:
        if self.parallel.dp is None:
            raise RuntimeError("num_microbatches needs a resolved config (call resolved())")
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.dp)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- loading


def _coerce(path: str, value: Any, annotation: Any) -> Any:
    """Check (and where lossless, convert) a YAML value against a field annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        non_none = [opt for opt in options if opt is not type(None)]
        return _coerce(path, value, non_none[0])
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if isinstance(value, str):
            value = [item.strip() for item in value.split(",") if item.strip()]
        if not isinstance(value, list):
            raise ValueError(f"{path}={value!r} must be a list")
        return [_coerce(f"{path}[{i}]", item, item_type) for i, item in enumerate(value)]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{path}={value!r} must be true or false")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"{path}={value!r} must be an integer")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no decimal point) as a string; it is the usual way to
            # write a learning rate, so accept any string Python parses as a float.
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"{path}={value!r} must be a number")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{path}={value!r} must be a string")
    raise TypeError(f"unsupported config annotation {annotation!r} for {path}")


def _apply(cfg: Config, section_name: str, key: str, value: Any) -> None:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section_name not in sections:
        raise ValueError(
            f"unknown config section {section_name!r} (in {section_name}.{key}); "
            f"valid sections are {sorted(sections)}"
        )
    section = getattr(cfg, section_name)
    hints = typing.get_type_hints(type(section))
    if key not in hints:
        raise ValueError(
            f"unknown config key {section_name}.{key}; valid keys in {section_name!r} are "
            f"{sorted(hints)}"
        )
    setattr(section, key, _coerce(f"{section_name}.{key}", value, hints[key]))


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, YAML-parsed value)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like section.key=value")
    dotted, raw = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"override key {dotted!r} must look like section.key")
    return parts[0], parts[1], yaml.safe_load(raw) if raw.strip() else ""


def config_from_dict(data: dict[str, Any] | None) -> Config:
    cfg = Config()
    for section_name, values in (data or {}).items():
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ValueError(f"config section {section_name!r} must be a mapping, got {values!r}")
        for key, value in values.items():
            _apply(cfg, section_name, key, value)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML file (or start from defaults), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping of sections")
    cfg = config_from_dict(data)
    for text in overrides:
        section_name, key, value = parse_override(text)
        _apply(cfg, section_name, key, value)
    cfg.validate()
    return cfg
