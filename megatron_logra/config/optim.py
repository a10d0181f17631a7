"""The ``optimizer``, ``logra`` (with its ``kl_control``) and ``lora`` sections: what trains the
model and how."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_logra.config.checks import (
    check_choice,
    check_finite,
    check_fraction,
    check_list_of_names,
    check_positive,
    validate_subsections,
)
from megatron_logra.config.moe import expert_ffn_width
from megatron_logra.controller import KLControlSettings
from megatron_logra.merge_chunks import MERGE_ROW_ALIGNMENT, min_host_chunk_mib

TARGET_NAMES: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
OPTIMIZERS: tuple[str, ...] = ("logra", "adam", "sgd", "lora")
NATIVE_OPTIMIZERS: tuple[str, ...] = ("adam", "sgd")
LR_DECAY_STYLES: tuple[str, ...] = ("constant", "linear", "cosine")
LOGRA_MODES: tuple[str, ...] = ("library", "paper")
DIRECTIONS: tuple[str, ...] = ("row_adam", "sgd", "paper_row_adam")
"""Direction rules (megatron_logra.direction maps each name to its rule)."""
DISTRIBUTIONS: tuple[str, ...] = ("rademacher", "gaussian", "identity")
"""Projection entries. megatron_logra.projection declares the same tuple: the portable generator
must import nothing else of ours (the rollout engine loads it on its own); a unit test keeps
the two equal."""
UPDATE_FACTOR_DTYPES: tuple[str, ...] = ("bf16", "fp32")
MASTER_WEIGHTS: tuple[str, ...] = ("auto", "none", "dp_sharded", "remainder", "host")
"""megatron_logra.master_weights maps each name (but ``auto``) to its master store."""
LOW_PRECISION_MASTERS: tuple[str, ...] = ("dp_sharded", "remainder", "host")
"""The modes that keep exact masters of bf16 weights."""
DEFAULT_MERGE_CHUNK_MIB = 64.0


@dataclass(frozen=True, kw_only=True)
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

    def validate(self, path: str = "optimizer") -> None:
        check_choice(f"{path}.name", self.name, OPTIMIZERS)
        check_choice(f"{path}.lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES)
        check_positive(f"{path}.lr", self.lr)
        check_positive(f"{path}.min_lr", self.min_lr, allow_zero=True)
        if self.min_lr > self.lr:
            raise ValueError(f"{path}.min_lr={self.min_lr} must not exceed {path}.lr={self.lr}")
        check_positive(f"{path}.lr_warmup_steps", self.lr_warmup_steps, allow_zero=True)
        check_positive(f"{path}.weight_decay", self.weight_decay, allow_zero=True)
        check_positive(f"{path}.clip_grad", self.clip_grad, allow_zero=True)
        for name in ("adam_beta1", "adam_beta2", "sgd_momentum"):
            check_fraction(f"{path}.{name}", getattr(self, name), closed="low")
        check_positive(f"{path}.adam_eps", self.adam_eps)


@dataclass(frozen=True, kw_only=True)
class KLControlConfig(KLControlSettings):
    """Predicted-KL step control of LoGRA updates; the controller's own settings (defaults: the
    paper's) are those of :class:`megatron_logra.controller.KLControlSettings`, which this
    section extends with what the run needs to drive it."""

    enabled: bool = False
    """Scale each LoGRA update to the predicted-KL budget."""
    temperature: float | None = None
    """Temperature of the policy whose KL is controlled (the KL is between temperature-scaled
    softmaxes). None: the sampling temperature in ``rl`` (rl.sampling.temperature; setting both
    to different values is refused), 1 in supervised runs."""
    mismatch_input: float | None = None
    """Supervised runs only: a rollout/trainer log-prob gap to feed the controller each step
    (RL runs measure it from the rollouts)."""

    def validate(self, path: str = "logra.kl_control") -> None:
        try:
            KLControlSettings.validate(self)
        except ValueError as error:
            raise ValueError(f"{path}.{error}") from error
        if self.temperature is not None:
            check_positive(f"{path}.temperature", self.temperature)
        if self.mismatch_input is not None:
            check_finite(f"{path}.mismatch_input", self.mismatch_input)


def check_host_merge_chunk(logra: LoGRAConfig, model: Any, tp: int) -> None:
    """``logra.merge_chunk_mib`` must hold one row group of every host-mastered target: a
    chunk is never rounded up past its budget (``model``: the model section)."""
    if logra.master_weights != "host":
        return
    widths = target_local_input_widths(model, tp, logra.targets)
    target, width = max(widths.items(), key=lambda item: item[1])
    if logra.merge_chunk_mib < min_host_chunk_mib(width):
        raise ValueError(
            f"logra.merge_chunk_mib={logra.merge_chunk_mib} holds no group of "
            f"{MERGE_ROW_ALIGNMENT} fp32 rows of {target} ({width} input columns per "
            f"tensor-parallel rank): a chunk is whole groups of rows, at most the budget; set "
            f"logra.merge_chunk_mib >= {min_host_chunk_mib(width):.4g}"
        )


def target_local_input_widths(model: Any, tp: int, targets: list[str]) -> dict[str, int]:
    """Each target's widest input per tensor-parallel rank (the row width its masters have):
    column-parallel qkv / fc1 see the whole hidden size, row-parallel proj / fc2 their slice of
    the heads' or of the widest FFN present (dense, routed expert, shared expert)."""
    ffn = [] if model.num_moe_experts is not None and model.moe_layer_freq == 1 else [
        model.ffn_hidden_size]
    if model.num_moe_experts is not None:
        ffn += [expert_ffn_width(model)]
        if model.moe_shared_expert_ffn_hidden_size is not None:
            ffn += [model.moe_shared_expert_ffn_hidden_size]
    widths = {"linear_qkv": model.hidden_size, "linear_fc1": model.hidden_size,
              "linear_proj": model.hidden_size // tp, "linear_fc2": max(ffn) // tp}
    return {name: widths[name] for name in targets}


def check_kl_control_settings_act(kl: KLControlConfig, optimizer_name: str) -> None:
    """Refuse the controller's settings in a LoGRA run whose KL control is off (with another
    optimizer the whole logra section is unselected, as the other loss preset's settings are:
    a dense baseline runs from the LoGRA run's own file)."""
    inert = kl_control_inert_settings(kl)
    if inert and optimizer_name == "logra":
        raise ValueError(
            f"{', '.join(inert)} with logra.kl_control.enabled=false: the KL control is off, "
            "so they would do nothing; set logra.kl_control.enabled=true or drop them"
        )


def kl_control_inert_settings(kl: KLControlConfig) -> list[str]:
    """``logra.kl_control.<key>=value`` of every controller setting that differs from its
    default, when the control is off (they would do nothing). The temperature is not among
    them: every run resolves it (rl to the sampling temperature, refusing another value)."""
    if kl.enabled:
        return []
    return [f"logra.kl_control.{item.name}={getattr(kl, item.name)}"
            for item in dataclasses.fields(kl)
            if item.name not in ("enabled", "temperature")
            and getattr(kl, item.name) != item.default]


@dataclass(frozen=True, kw_only=True)
class LoGRAConfig:
    """Low-rank gradient sketches on the target linears (used when optimizer.name=logra)."""

    mode: str = "library"
    """``library``: RowAdam direction, lr schedule, clipping, non-targets trained natively.
    ``paper``: the paper's RowAdam, a global update ratio instead of a learning rate, no
    clipping, every non-target parameter frozen (use with logra.kl_control.enabled=true)."""
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
    """Where the exact masters of the sketched weights live: ``none`` (fp32 weights are their
    own masters), and for bf16 weights, by whole rows sharded over data parallelism:
    ``dp_sharded`` (fp32 rows on the device, 4/dp B per target parameter), ``remainder`` (the
    int16 low halves only, the bf16 weight being the high half: 2/dp B, bit-identical results),
    ``host`` (fp32 rows in pinned host memory, streamed through the device at the merge: ~0 B,
    bit-identical results on CPU, a copy per step); ``auto``: none for fp32, dp_sharded for
    bf16."""
    merge_chunk_mib: float = DEFAULT_MERGE_CHUNK_MIB
    """master_weights=host: at most this many MiB of fp32 master rows per chunk streamed through
    the device at the merge (two chunks are staged on the device at a time). A chunk is the
    most whole groups of 192 rows that fit (the GEMM row alignment that keeps a chunked merge
    bit-identical to a one-call one on CPU, megatron_logra.merge_chunks); a budget below one
    group of the widest target (192 x its local input width x 4 B) is refused."""
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
    kl_control: KLControlConfig = field(default_factory=KLControlConfig)

    def validate(self, path: str = "logra") -> None:
        check_choice(f"{path}.mode", self.mode, LOGRA_MODES)
        check_choice(f"{path}.distribution", self.distribution, DISTRIBUTIONS)
        check_choice(f"{path}.direction", self.direction, ("auto", *DIRECTIONS))
        check_choice(f"{path}.update_factor_dtype", self.update_factor_dtype,
                     UPDATE_FACTOR_DTYPES)
        check_positive(f"{path}.update_ratio", self.update_ratio)
        # A proposal as large as the weights is applied as is without KL control; with it, the
        # controller scales any proposal to the KL budget (a stress test may propose 3.0).
        if self.update_ratio >= 1.0 and not self.kl_control.enabled:
            raise ValueError(
                f"{path}.update_ratio={self.update_ratio} must be < 1 without KL control: it is "
                "the proposed update's norm relative to the target weights' (the paper uses "
                "6e-5); lower it, or set logra.kl_control.enabled=true to scale it to a KL budget"
            )
        check_choice(f"{path}.native_optimizer", self.native_optimizer, NATIVE_OPTIMIZERS)
        check_choice(f"{path}.master_weights", self.master_weights, MASTER_WEIGHTS)
        check_positive(f"{path}.merge_chunk_mib", self.merge_chunk_mib)
        if self.master_weights != "host" and self.merge_chunk_mib != DEFAULT_MERGE_CHUNK_MIB:
            raise ValueError(
                f"{path}.merge_chunk_mib={self.merge_chunk_mib} sizes the chunks of host "
                f"masters; with {path}.master_weights={self.master_weights} it would do nothing: "
                f"set {path}.master_weights=host or drop the override"
            )
        check_positive(f"{path}.sketch_rank", self.sketch_rank)
        check_positive(f"{path}.seed", self.seed, allow_zero=True)
        check_fraction(f"{path}.beta2", self.beta2, closed="low")
        check_positive(f"{path}.eps", self.eps)
        check_list_of_names(f"{path}.targets", self.targets, TARGET_NAMES)
        validate_subsections(self, path)


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """LoRA adapters on the target linears (optimizer.name=lora), trained with Adam under the
    optimizer section's settings: the memory baseline LoGRA is compared with."""

    lora_rank: int = 16
    alpha: float = 32.0
    """The adapter output is scaled by alpha / lora_rank."""
    seed: int = 0
    """Seeds the down projections A (B starts at zero), the same at every TP size."""
    targets: list[str] = field(default_factory=lambda: list(TARGET_NAMES))

    def validate(self, path: str = "lora") -> None:
        check_positive(f"{path}.lora_rank", self.lora_rank)
        check_positive(f"{path}.alpha", self.alpha)
        check_positive(f"{path}.seed", self.seed, allow_zero=True)
        check_list_of_names(f"{path}.targets", self.targets, TARGET_NAMES)
