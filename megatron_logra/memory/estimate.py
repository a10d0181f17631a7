"""Analytic per-GPU training memory of dense Adam, LoRA and LoGRA on a Megatron-Core layout.

Everything is counted in bytes on one GPU of the first pipeline stage, the stage Megatron's own
theoretical-memory formula reports: it holds the embedding and, under a pipeline schedule, the
most microbatches in flight. (With pp > 1 the last stage holds the output layer and the
cross-entropy logits instead; for a very large vocabulary it can be the fuller one, which this
estimate, like Megatron's, does not report.)

Model shapes and layouts are :mod:`.shapes`, saved activations :mod:`.activations`; this module\nholds the methods' totals. Five persistent categories, the same ones :mod:`megatron_logra.mcore.training.state_bytes` measures, plus
the saved activations of one step:

* ``weights``: the model's parameters in their storage dtype (LoRA: base + adapters).
* ``gradients``: fp32 gradient buffers (Megatron DDP's ``main_grad``) of what Adam trains.
* ``optimizer_state``: Adam's m and v, fp32 master copies, LoGRA's fp32 masters and row moments.
* ``sketches``: LoGRA's fp32 ``[m_local, r]`` sketch of every target.
* ``projections``: LoGRA's ``[r, n_local]`` projection of every target, held once in the
  parameters' dtype (regenerated from a seed after each update and cached for the step).
* ``activations``: tensors saved for backward, per Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models", section 4 and Table 2), generalised to grouped-query
  attention, separate head width, gated MLPs and dropout-free models, and multiplied by the
  microbatches in flight exactly as Megatron-LM's theoretical-memory formula does.

With ``Layout.attention`` set (``sdpa``, ``local``, ``te``: what ``model.attention`` builds), the
activations are those of the layer our trainer builds (:mod:`.built_layer`: torch norms, the
unfused gated MLP, the attention kernel's own tensors, recompute per mode) at the backward's
peak, beside the gradients alive then (``temporaries``) and a persistent work buffer
(``buffers``); LoGRA's paper-mode weight norms and KL probe run after backward
(:mod:`.step_phases`, ``after_backward``), and the step's peak is the larger of the two. Checked
against the live-tensor tracker on the model the product builds (tools/estimate_vs_measured.py).
:func:`megatron_logra.memory.from_config.estimate_for_config` maps a run's config to all this.

Not modelled (each is small or transient): torch Adam's 4-byte step counter per parameter
tensor, DDP grad-buffer alignment padding, communication buffers, allocator fragmentation, the
CUDA context, and temporaries of the optimizer step other than those above (e.g. LoGRA's
``D A`` product per target, the fp32 cast of one projection during the merge, torch Adam's
per-tensor temporaries).

Bytes per parameter, by method and precision (``dp`` = data-parallel size; ``/dp`` only with
Megatron's distributed optimizer, or for LoGRA's sharded masters):

=========================  =======  =====  ==========================================
what                       weights  grads  optimizer state
=========================  =======  =====  ==========================================
dense Adam, bf16           2        4      12 (fp32 master + m + v), or 12/dp
dense Adam, fp32           4        4      8 (m + v; the params are the masters), or 8/dp
LoRA base (frozen)         2 or 4   --     --
LoRA adapters              like dense Adam in the same precision
LoGRA target, fp32         4        --     --
LoGRA target, bf16 shard   2        --     4/dp (fp32 master shard), 2/dp (int16 remainders),
                                            or 0 (fp32 master shard in host memory: 4/dp)
LoGRA non-target           like dense Adam ("library" mode), or weights only ("frozen")
=========================  =======  =====  ==========================================

plus, per LoGRA target with ``m_local`` rows and ``n_local`` input columns on the rank: a row
moment of 4 bytes per row (4/dp when sharded), a sketch of ``4 m_local r`` and a projection of
``e r n_local`` bytes (e = 2 with bf16 parameters, 4 with fp32). Saved activations: a sketched linear keeps ``X A^T`` (r wide) where the
dense one keeps its input X (n_local wide); a LoRA linear keeps X and ``X A^T`` of its adapter.

In ``bf16_sharded_master`` mode the sketch is reduce-scattered over data parallelism so that each
rank keeps masters and row moments only for its share of rows, but the full ``[m_local, r]`` sketch
is accumulated during backward, before that reduce-scatter: the peak holds all of it, and so does
this estimate.

Shape symbols: h hidden, F ffn hidden, a heads, g query groups, d head width, qd = a d (query
width), kvd = g d (key/value width), V padded vocabulary, L layers, t = tp, T = seq x micro-batch
tokens, T_s = T / t under sequence parallelism and T otherwise, r rank, e activation element bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_logra.memory.activations import (
    LINEAR_MODES,
    ActivationBreakdown,
    element_bytes,
    layer_activation_terms,
    stage_activation_bytes,
)
from megatron_logra.memory.built_layer import cp_mask_bytes, local_attention_buffer_bytes
from megatron_logra.memory.megatron_formula import MegatronFormula, megatron_formula
from megatron_logra.memory.shapes import (
    FP32_BYTES,
    GIB,
    LOGRA_MASTER_GPU_BYTES,
    LOGRA_PRECISION_OF_MASTER_WEIGHTS,
    LOGRA_PRECISIONS,
    NON_TARGET_TRAINING,
    PRECISIONS,
    PRESETS,
    RECOMPUTE_MODES,
    TARGET_LINEARS,
    Layout,
    ModelShape,
    TargetLinear,
    adam_bytes,
    bias_params,
    check_choice,
    check_positive_int,
    preset,
    shape_from_model_config,
)
from megatron_logra.memory.step_phases import KLProbe, kl_probe_bytes, paper_weight_norm_bytes

__all__ = [
    "GIB", "KLProbe", "LINEAR_MODES", "LOGRA_PRECISION_OF_MASTER_WEIGHTS", "LOGRA_PRECISIONS", "NON_TARGET_TRAINING", "PRECISIONS", "PRESETS",
    "RECOMPUTE_MODES", "TARGET_LINEARS", "ActivationBreakdown", "Layout", "MegatronFormula",
    "MemoryBreakdown", "MethodSettings", "ModelShape", "StageParameters", "TargetLinear",
    "dense_adam_memory", "estimate_all", "fits", "layer_activation_terms", "logra_memory",
    "lora_adapter_parameters", "lora_memory", "megatron_formula", "preset",
    "shape_from_model_config", "stage_activation_bytes", "stage_parameters",
]


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU of the first pipeline stage, by category."""

    method: str
    precision: str
    weights: float
    gradients: float
    optimizer_state: float
    sketches: float
    projections: float
    activations: float
    host_optimizer_state: float = 0.0
    """Beside the GPU, in host memory (LoGRA's host masters): not in any GPU total."""
    buffers: float = 0.0
    """Work buffers the model keeps between steps (``local`` attention's ``baddbmm`` input)."""
    temporaries: float = 0.0
    """Gradients alive beside the saved activations at the backward's peak."""
    after_backward: float = 0.0
    """The largest transient of the step after backward, when no activation is alive (paper
    mode's weight norms, the KL probe's proposal, logits, tangents and float64 chunks)."""

    CATEGORIES = ("weights", "gradients", "optimizer_state", "sketches", "projections",
                  "buffers", "activations", "temporaries", "after_backward")

    @property
    def persistent(self) -> float:
        """State that lives between steps."""
        return (self.weights + self.gradients + self.optimizer_state + self.sketches
                + self.projections + self.buffers)

    @property
    def step_peak(self) -> float:
        """The step's peak above the persistent state: backward's (saved activations and the
        gradients beside them) or a later phase's, whichever is larger."""
        return max(self.activations + self.temporaries, self.after_backward)

    @property
    def total(self) -> float:
        return self.persistent + self.step_peak

    def as_dict(self) -> dict[str, float | str]:
        out: dict[str, float | str] = {"method": self.method, "precision": self.precision,
                                       "total_gib": self.total / GIB,
                                       "persistent_gib": self.persistent / GIB}
        for name in self.CATEGORIES:
            out[f"{name}_gib"] = getattr(self, name) / GIB
        for name in (*self.CATEGORIES, "persistent", "step_peak", "total"):
            out[f"{name}_bytes"] = round(getattr(self, name))
        out["host_optimizer_state_bytes"] = round(self.host_optimizer_state)
        return out


# ----------------------------------------------------------------------------- parameters


@dataclass(frozen=True)
class StageParameters:
    """Parameters on one GPU of the first pipeline stage.

    Attributes:
        targets: the target linears' weights (all four per layer, TP-local).
        non_targets: everything else: embeddings (and the output layer and final norm when
            pp = 1), norms, biases.
        layers: transformer layers on the stage.
    """

    targets: int
    non_targets: int
    layers: int


def stage_parameters(
    shape: ModelShape, layout: Layout, targets: tuple[str, ...] = TARGET_LINEARS
) -> StageParameters:
    """Exact per-rank parameter counts of the first stage (norms and row biases replicated).
    An MoE layer counts its attention, its shared expert and its router here; its routed
    experts are counted apart (:func:`expert_bytes`)."""
    layout.check_fits(shape)
    tp = layout.tp
    layers = shape.num_layers // layout.pp
    target_params = 0
    non_targets = 0
    for is_moe, count in shape.layer_kinds():
        count = count if shape.moe is not None else layers  # experts: pp = 1
        other_linear_params = 0
        for target in shape.layer_targets(is_moe):
            params = target.local_rows(tp) * target.local_cols(tp)
            if target.name in targets:
                target_params += count * params
            else:
                other_linear_params += params
        router = shape.router_params() if is_moe else 0
        non_targets += count * (other_linear_params + shape.norm_params_per_layer()
                                + bias_params(shape, tp) + router)
    embedding = shape.padded_vocab_size(tp) // tp * shape.hidden_size
    non_targets += embedding + shape.learned_positions * shape.hidden_size
    if layout.pp == 1:
        final_norm = shape.hidden_size * (2 if shape.normalization == "LayerNorm" else 1)
        non_targets += final_norm + (0 if shape.tied_embeddings else embedding)
    return StageParameters(targets=target_params, non_targets=non_targets, layers=layers)


def _target_sums(shape: ModelShape, layout: Layout, targets: tuple[str, ...]) -> tuple[int, int]:
    """(sum of local rows, sum of local input columns) over the stage's (non-expert) target
    linears."""
    rows = cols = 0
    layers = shape.num_layers // layout.pp
    for is_moe, count in shape.layer_kinds():
        count = count if shape.moe is not None else layers
        for target in shape.layer_targets(is_moe):
            if target.name in targets:
                rows += count * target.local_rows(layout.tp)
                cols += count * target.local_cols(layout.tp)
    return rows, cols


def expert_bytes(shape: ModelShape, layout: Layout, *, method: str, precision: str,
                 sketch_rank: int = 256, distributed_optimizer: bool = True) -> dict[str, float]:
    """The routed experts' persistent bytes on one GPU, by category (all 0 for a dense
    model): :func:`megatron_logra.memory.experts.expert_state_bytes` on this layout (experts
    over ``ep``, expert TP = tp, state over the ``dp / ep`` expert-DP ranks)."""
    from megatron_logra.memory.experts import CATEGORIES, expert_shape_of, expert_state_bytes

    if shape.moe is None:
        return dict.fromkeys(CATEGORIES, 0.0)
    return expert_state_bytes(expert_shape_of(shape), method=method, ep=layout.ep,
                              expert_tp=layout.tp, expert_dp=layout.expert_dp,
                              precision=precision, sketch_rank=sketch_rank,
                              distributed_optimizer=distributed_optimizer)


def lora_adapter_parameters(
    shape: ModelShape, layout: Layout, lora_rank: int, targets: tuple[str, ...] = TARGET_LINEARS
) -> int:
    """Adapter parameters on one GPU of the first stage.

    Each target gets ``A [r, n]`` and ``B [m, r]`` split like the layer's input and output:
    column-parallel layers keep the full A and ``m/tp`` rows of B; row-parallel layers keep the
    ``n/tp`` columns of A and the full B.
    """
    check_positive_int("lora_rank", lora_rank, "use the LoRA rank, e.g. 256")
    per_layer = 0
    for target in shape.targets():
        if target.name in targets:
            per_layer += lora_rank * (target.local_cols(layout.tp) + target.local_rows(layout.tp))
    return (shape.num_layers // layout.pp) * per_layer


# ----------------------------------------------------------------------------- methods


def _model_extras(shape: ModelShape, layout: Layout, activations: ActivationBreakdown,
                  e: int) -> dict[str, float]:
    """The model's persistent work buffers and the backward's temporaries (both 0 under
    Korthikanti's accounting, ``layout.attention`` None)."""
    return {"buffers": local_attention_buffer_bytes(shape, layout, e) + cp_mask_bytes(layout, e),
            "temporaries": activations.temporaries}


def _check_targets(targets: tuple[str, ...]) -> None:
    if not targets:
        raise ValueError(f"targets is empty; choose from {list(TARGET_LINEARS)}")
    for name in targets:
        if name not in TARGET_LINEARS:
            raise ValueError(f"targets contains {name!r}; valid targets are {list(TARGET_LINEARS)}")


def dense_adam_memory(
    shape: ModelShape, layout: Layout, *, distributed_optimizer: bool = True,
    precision: str = "bf16",
) -> MemoryBreakdown:
    """Every parameter trained by Megatron's Adam (the baseline of Megatron's formula)."""
    check_choice("precision", precision, PRECISIONS)
    params = stage_parameters(shape, layout)
    weights, grads, state = adam_bytes(params.targets + params.non_targets, precision,
                                       distributed_optimizer, layout.dp_cp)
    experts = expert_bytes(shape, layout, method="dense_adam", precision=precision,
                           distributed_optimizer=distributed_optimizer)
    weights += experts["weights"]
    grads += experts["gradients"]
    state += experts["optimizer_state"]
    activations = stage_activation_bytes(
        shape, layout, element_bytes=element_bytes(precision),
        linear_modes=dict.fromkeys(TARGET_LINEARS, "dense"),
    )
    return MemoryBreakdown("dense_adam", precision, weights, grads, state, 0.0, 0.0,
                           activations.at_peak, **_model_extras(shape, layout, activations,
                                                              element_bytes(precision)))


def lora_memory(
    shape: ModelShape, layout: Layout, *, lora_rank: int = 256,
    distributed_optimizer: bool = True, precision: str = "bf16",
    targets: tuple[str, ...] = TARGET_LINEARS,
) -> MemoryBreakdown:
    """Frozen base model; adapters on ``targets`` trained by Megatron's Adam.

    Everything that is not an adapter is frozen (embeddings, norms, biases, output layer), as in
    the usual LoRA recipe, so those layers save no inputs for weight gradients either.
    """
    check_choice("precision", precision, PRECISIONS)
    _check_targets(targets)
    if shape.moe is not None:
        raise ValueError(f"{shape.name} has experts: LoRA is refused for MoE by the trainer "
                         "(optimizer.name=lora: its targets are dense linears, docs/moe.md); "
                         "estimate dense Adam or LoGRA")
    params = stage_parameters(shape, layout)
    adapters = lora_adapter_parameters(shape, layout, lora_rank, targets)
    a_weights, a_grads, a_state = adam_bytes(adapters, precision, distributed_optimizer,
                                              layout.dp_cp)
    base = element_bytes(precision) * (params.targets + params.non_targets)
    modes = {name: ("lora" if name in targets else "frozen") for name in TARGET_LINEARS}
    activations = stage_activation_bytes(
        shape, layout, element_bytes=element_bytes(precision), linear_modes=modes,
        rank=lora_rank, embedding_trained=False, output_layer_trained=False,
    )
    return MemoryBreakdown("lora", precision, base + a_weights, a_grads, a_state, 0.0, 0.0,
                           activations.at_peak, **_model_extras(shape, layout, activations,
                                                              element_bytes(precision)))


def logra_memory(
    shape: ModelShape, layout: Layout, *, sketch_rank: int = 256,
    precision: str = "bf16_sharded_master", distributed_optimizer: bool = True,
    non_targets: str = "adam", targets: tuple[str, ...] = TARGET_LINEARS,
    paper_mode: bool = False, kl_probe: KLProbe | None = None,
) -> MemoryBreakdown:
    """Sketched ``targets``; the rest trained by Megatron's Adam (library mode) or frozen.

    ``fp32``: fp32 params everywhere, each DP rank keeps the full sketch and row moments.
    ``bf16_*``: bf16 params; each DP rank keeps exact masters and row moments for its 1/dp share
    of target rows, the masters as fp32 on the GPU (``bf16_sharded_master``), as int16
    remainders on the GPU (``bf16_remainder``) or as fp32 in host memory (``bf16_host_master``,
    whose chunked merge stages ``2 * logra.merge_chunk_mib`` transiently, not counted).
    Non-target parameters follow Megatron's Adam in the same precision (bf16 with fp32 grads
    and state; fp32).
    """
    check_choice("precision", precision, LOGRA_PRECISIONS)
    check_choice("non_targets", non_targets, NON_TARGET_TRAINING)
    _check_targets(targets)
    check_positive_int("sketch_rank", sketch_rank, "use the sketch rank, e.g. 256")
    if shape.moe is not None:
        _check_logra_moe(shape, precision, non_targets, paper_mode, targets)
        if kl_probe is not None:
            raise ValueError(f"{shape.name} has experts: the KL probe's forward-mode pass "
                             "through an MoE layer is not modelled; estimate with "
                             "logra.kl_control.enabled=false")
    params = stage_parameters(shape, layout, targets)
    rows, cols = _target_sums(shape, layout, targets)
    sharded = precision != "fp32"
    adam_precision = "bf16" if sharded else "fp32"
    e = element_bytes(adam_precision)
    if non_targets == "adam":
        weights, grads, state = adam_bytes(params.non_targets, adam_precision,
                                            distributed_optimizer, layout.dp_cp)
    else:
        weights, grads, state = e * params.non_targets, 0.0, 0.0
    weights += e * params.targets
    shard = layout.dp_cp if sharded else 1
    state += LOGRA_MASTER_GPU_BYTES[precision] * params.targets / shard  # master shard
    host = FP32_BYTES * params.targets / shard if precision == "bf16_host_master" else 0.0
    state += FP32_BYTES * rows / shard  # RowAdam second moment, one per output row
    sketches = FP32_BYTES * rows * sketch_rank  # full buffer: accumulated before any reduction
    projections = e * sketch_rank * cols  # held once, in the parameters' dtype
    experts = expert_bytes(shape, layout, method="logra", precision=precision,
                           sketch_rank=sketch_rank, distributed_optimizer=distributed_optimizer)
    weights += experts["weights"]
    state += experts["optimizer_state"]
    sketches += experts["sketches"]
    projections += experts["projections"]
    modes = {name: ("sketched" if name in targets else
                    ("dense" if non_targets == "adam" else "frozen")) for name in TARGET_LINEARS}
    activations = stage_activation_bytes(
        shape, layout, element_bytes=e, linear_modes=modes, rank=sketch_rank,
        embedding_trained=non_targets == "adam", output_layer_trained=non_targets == "adam",
    )
    after_backward = 0.0
    if paper_mode:
        after_backward = paper_weight_norm_bytes(shape, layout, targets)
    if kl_probe is not None:
        # The proposal holds -lr D of every target, fp32, gathered over DP: sketch-sized.
        after_backward = max(after_backward, kl_probe_bytes(
            shape, layout, kl_probe, e, direction_bytes=sketches))
    extras = _model_extras(shape, layout, activations, e)
    if kl_probe is not None and kl_probe.padded(layout) != layout.seq_length:
        # The probe's own sequence length gets masks of its own (CPU, context parallelism).
        extras["buffers"] += cp_mask_bytes(layout, e, kl_probe.padded(layout))
    return MemoryBreakdown("logra", precision, weights, grads, state, sketches, projections,
                           activations.at_peak, host_optimizer_state=host, **extras,
                           after_backward=after_backward)


def _check_logra_moe(shape: ModelShape, precision: str, non_targets: str, paper_mode: bool,
                     targets: tuple[str, ...]) -> None:
    """What LoGRA's estimate of an MoE model covers: what the trainer builds."""
    from megatron_logra.memory.experts import EXPERT_LOGRA_PRECISIONS

    if precision not in EXPERT_LOGRA_PRECISIONS:
        raise ValueError(f"{shape.name} has experts: LoGRA precision={precision!r} is not "
                         f"estimated for experts; choose one of {list(EXPERT_LOGRA_PRECISIONS)}")
    if paper_mode or non_targets != "adam":
        raise ValueError(f"{shape.name} has experts: LoGRA's paper mode (frozen non-targets, "
                         "the update ratio's weight norms) is not modelled for experts; "
                         "estimate library mode (non_targets='adam')")
    if not {"linear_fc1", "linear_fc2"} <= set(targets):
        raise ValueError(f"{shape.name} has experts: the experts' fc1 and fc2 are always "
                         "sketched (they never get a dense gradient); keep linear_fc1 and "
                         "linear_fc2 in targets")


# ----------------------------------------------------------------------------- all methods


@dataclass(frozen=True, kw_only=True)
class MethodSettings:
    """What the three methods are compared with."""

    distributed_optimizer: bool = True
    precision: str = "bf16"
    """Dense Adam and LoRA precision (``bf16`` or ``fp32``)."""
    lora_rank: int = 256
    sketch_rank: int = 256
    logra_precision: str = "bf16_sharded_master"
    logra_non_targets: str = "adam"
    targets: tuple[str, ...] = TARGET_LINEARS
    logra_paper_mode: bool = False
    """LoGRA's paper mode: its update ratio computes the target weights' norm after backward."""
    kl_probe: KLProbe | None = None
    """LoGRA's predicted-KL step control and its probe on one DP rank (None: off)."""


def estimate_all(
    shape: ModelShape, layout: Layout, settings: MethodSettings | None = None
) -> dict[str, MemoryBreakdown]:
    """``{"dense_adam": ..., "lora": ..., "logra": ...}`` for one model and layout (no
    ``lora`` for an MoE model: the trainer refuses it)."""
    st = settings or MethodSettings()
    lora = {} if shape.moe is not None else {  # refused for MoE (lora_memory says why)
        "lora": lora_memory(shape, layout, lora_rank=st.lora_rank, precision=st.precision,
                            distributed_optimizer=st.distributed_optimizer, targets=st.targets)}
    return {
        "dense_adam": dense_adam_memory(shape, layout, precision=st.precision,
                                        distributed_optimizer=st.distributed_optimizer),
        **lora,
        "logra": logra_memory(shape, layout, sketch_rank=st.sketch_rank,
                              precision=st.logra_precision,
                              distributed_optimizer=st.distributed_optimizer,
                              non_targets=st.logra_non_targets, targets=st.targets,
                              paper_mode=st.logra_paper_mode, kl_probe=st.kl_probe),
    }


def fits(breakdown: MemoryBreakdown, gpu_mem_gib: float) -> bool:
    """Whether the estimate is within one GPU's memory (every GPU holds at most this much)."""
    if gpu_mem_gib <= 0:
        raise ValueError(f"gpu_mem_gib={gpu_mem_gib} must be > 0; give the GPU memory in GiB")
    return breakdown.total <= gpu_mem_gib * GIB
