"""The exact first-order change of a GPT's logits along a proposed low-rank weight update.

For the predicted-KL step controller: given this rank's model chunk, a probe batch, and for each
target linear a low-rank update of its local weight shard ``dW_local = left @ right``,
:func:`logit_jvp` returns this rank's vocab shard of the logits ``z`` and of their directional
derivative ``dz = J dW`` (a Jacobian-vector product), computed in one forward pass with
``torch.autograd.forward_ad``. For LoGRA's update ``-scale * D A``: ``left = -scale * D_local``
and ``right = A_local`` (the full A for a column-parallel layer, its column slice
``A[:, col_start:col_end]`` for a row-parallel one, whose ``D`` is the full ``[m, r]``).

How the tangent enters. The weights are not modified and no dense ``dW`` is formed: a forward hook
on each target adds the output tangent ``dY = X dW^T = (X right^T) left^T`` to the layer's output,
doing the tensor-parallel communication for that term itself, exactly as Megatron does for the
primal:

* column-parallel: under sequence parallelism Megatron all-gathers the sequence-sharded input
  inside its linear; here the small ``P = X_local right^T [s/tp, b, k]`` is gathered instead;
* row-parallel: each rank's ``dY`` is a partial sum over its input columns, all-reduced (or
  reduce-scattered over the sequence under sequence parallelism) like Megatron's primal output.

Tangents from upstream layers then flow through Megatron's own Functions by the jvp rules of
:mod:`megatron_logra.mcore.compat.forward_ad`, so every target's contribution reaches the logits.

Non-target parameters (embeddings, norms, biases, output layer; trained by Adam in library mode)
can carry a tangent too (``parameter_tangents``, keyed by global parameter name): for that one
forward the parameter is replaced by a dual tensor, and Megatron routes it through its
frozen-weight linear, whose jvp rule adds the ``X dW^T`` term.

Pipeline parallelism: the probe batch is passed stage to stage with point-to-point messages
(primal and tangent separately), virtual stage by virtual stage (:func:`staged_forward`).
Shape names: s = sequence, b = micro-batch, k = rank of the direction, V = vocab shard.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_logra.mcore.compat.forward_ad import install_forward_ad_rules
from megatron_logra.mcore.models.sharding import global_named_parameters, unwrap_model
from megatron_logra.mcore.models.targets import SketchTarget
from megatron_logra.mcore.tensor_parallel.seq_collectives import (
    all_gather_first_dim,
    reduce_scatter_first_dim,
)


class LowRankDirection(NamedTuple):
    """``dW_local = left @ right`` for one target's local weight shard ``[rows_local, n_local]``.

    Attributes:
        left: ``[rows_local, k]``.
        right: ``[k, n_local]``.
    """

    left: torch.Tensor
    right: torch.Tensor


@dataclass(frozen=True)
class LogitJVP:
    """This rank's vocab shard of the logits and of their first-order change.

    Attributes:
        logits: ``[b, s, V_local]``, bit-identical to a plain forward of the same model.
        tangent: ``[b, s, V_local]``, ``dz = J dW`` in the model's dtype.
    """

    logits: torch.Tensor
    tangent: torch.Tensor


LOST_TANGENT = (
    "the logits carry no forward-mode tangent: an operation between the perturbed layers and "
    "the output dropped it (a raw collective on a dual tensor, .data, .detach(), or a kernel "
    "without a forward-AD formula)"
)


def _tp_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)




def _compute_dtype(activation_dtype: torch.dtype) -> torch.dtype:
    """Factor products in fp32 at least (bf16 would round the small update term), fp64 in an
    fp64 model (the exact reference)."""
    return torch.float64 if activation_dtype == torch.float64 else torch.float32


def _output_tangent(
    target: SketchTarget, input_: torch.Tensor, direction: LowRankDirection, out_shape: torch.Size
) -> torch.Tensor:
    """``dY = X dW^T`` for one target, laid out and reduced like Megatron's primal output."""
    module = target.module
    group = module.tp_group
    tp = _tp_size(group)
    dtype = _compute_dtype(input_.dtype)
    left, right = direction.left.to(dtype), direction.right.to(dtype)
    projected = torch.matmul(input_.to(dtype), right.t())  # [s_local, b, k]
    if getattr(module, "explicit_expert_comm", False):
        # A routed expert's linear under expert or tensor parallelism: the token dispatcher
        # does the communication (tokens in, partial outputs out) and the linear none, so its
        # tangent is local too -- the dispatcher's own collectives carry it by their jvp rules.
        tangent = torch.matmul(projected, left.t())  # [tokens, rows_local]
    elif isinstance(module, ColumnParallelLinear):
        if module.gather_output:
            raise RuntimeError(
                f"{target.layer_key} gathers its output over tensor parallelism; LoGRA targets "
                "are column-parallel linears with gather_output=False"
            )
        if module.sequence_parallel and tp > 1:
            projected = all_gather_first_dim(projected, group)
        tangent = torch.matmul(projected, left.t())  # [s, b, rows_local]
    elif isinstance(module, RowParallelLinear):
        if not module.input_is_parallel:
            raise RuntimeError(
                f"{target.layer_key}: only row-parallel linears with input_is_parallel=True "
                "can be probed"
            )
        tangent = torch.matmul(projected, left.t())  # [s_local_or_s, b, m] partial sum
        if tp > 1:
            if module.sequence_parallel:
                tangent = reduce_scatter_first_dim(tangent, group)
            else:
                dist.all_reduce(tangent, group=group)
    else:
        raise TypeError(f"{target.layer_key} is a {type(module).__name__}, not a parallel linear")
    if tangent.shape != out_shape:
        raise RuntimeError(
            f"{target.layer_key}: injected tangent has shape {tuple(tangent.shape)} but the layer "
            f"output is {tuple(out_shape)}"
        )
    return tangent


def _injection_hook(target: SketchTarget, direction: LowRankDirection) -> Any:
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        input_ = args[0] if args else kwargs["input_"]
        primal_input = fwAD.unpack_dual(input_).primal
        out, bias = output
        primal_out, upstream = fwAD.unpack_dual(out)
        tangent = _output_tangent(target, primal_input, direction, primal_out.shape)
        tangent = tangent.to(primal_out.dtype)
        if upstream is not None:
            tangent = tangent.add_(upstream) if tangent.dtype == upstream.dtype else (
                upstream + tangent)
        # The same primal (a view, not a copy) with this layer's term added to any upstream
        # tangent.
        return fwAD.make_dual(primal_out, tangent), bias

    return hook


def _check_directions(
    targets: Sequence[SketchTarget], directions: Mapping[str, LowRankDirection]
) -> dict[str, SketchTarget]:
    by_key = {target.layer_key: target for target in targets}
    unknown = sorted(set(directions) - set(by_key))
    if unknown:
        raise ValueError(
            f"directions name layers that are not among the targets: {unknown[:4]}; use the "
            f"targets' layer_key (e.g. {next(iter(by_key), '<none>')!r})"
        )
    for key, direction in directions.items():
        target = by_key[key]
        left, right = direction
        n_local = target.col_end - target.col_start
        if (
            left.dim() != 2 or right.dim() != 2 or left.shape[0] != target.rows
            or right.shape[1] != n_local or left.shape[1] != right.shape[0]
        ):
            raise ValueError(
                f"direction for {key}: left {tuple(left.shape)} @ right {tuple(right.shape)} "
                f"must form the local weight shard [{target.rows}, {n_local}] as "
                "[rows_local, k] @ [k, n_local]"
            )
    return by_key


@dataclass(frozen=True)
class _DualParameter:
    module: torch.nn.Module
    attr: str
    original: torch.nn.Parameter
    tangent: torch.Tensor


def _dual_parameters(
    chunk: torch.nn.Module,
    targets: Sequence[SketchTarget],
    parameter_tangents: Mapping[str, torch.Tensor],
) -> list[_DualParameter]:
    model = unwrap_model(chunk)
    local_names = {id(param): name for name, param in model.named_parameters()}
    by_global = dict(global_named_parameters(chunk))
    target_weights = {id(target.weight) for target in targets}
    duals = []
    for name, tangent in parameter_tangents.items():
        param = by_global.get(name)
        if param is None:
            raise ValueError(
                f"parameter_tangents names {name!r}, which is not a parameter of this model "
                "chunk; use global parameter names (megatron_logra.mcore.models.sharding."
                "global_named_parameters)"
            )
        if id(param) in target_weights:
            raise ValueError(
                f"parameter_tangents names the target weight {name!r}; give its update as a "
                "low-rank direction instead"
            )
        if tangent.shape != param.shape or tangent.dtype != param.dtype:
            raise ValueError(
                f"tangent for {name!r} is {tuple(tangent.shape)} {tangent.dtype}; it must match "
                f"the local parameter {tuple(param.shape)} {param.dtype}"
            )
        if tangent.device != param.device:
            raise ValueError(
                f"tangent for {name!r} is on {tangent.device}, the parameter on {param.device}"
            )
        module_name, _, attr = local_names[id(param)].rpartition(".")
        module = model.get_submodule(module_name)
        duals.append(_DualParameter(module, attr, param, tangent))
    return duals


@dataclass(frozen=True)
class PipelinePosition:
    """Where this rank sits in the pipeline, for forwards outside Megatron's schedules.

    The model's virtual stages run in order ``v = chunk * pp_size + pp_rank``; stage ``v``
    receives its input from stage ``v - 1`` and sends its output to stage ``v + 1``.
    """

    pp_rank: int
    pp_size: int
    pp_group: dist.ProcessGroup | None

    def neighbour(self, offset: int) -> int:
        return dist.get_global_rank(self.pp_group, (self.pp_rank + offset) % self.pp_size)


def _hidden_shape(chunk: torch.nn.Module, tokens: torch.Tensor) -> tuple[int, int, int]:
    config = unwrap_model(chunk).config
    seq = tokens.shape[1]
    if config.sequence_parallel and config.tensor_model_parallel_size > 1:
        seq //= config.tensor_model_parallel_size
    return seq, tokens.shape[0], config.hidden_size


def _activation_dtype(chunk: torch.nn.Module) -> torch.dtype:
    config = unwrap_model(chunk).config
    return torch.bfloat16 if config.bf16 else next(unwrap_model(chunk).parameters()).dtype


def staged_forward(
    model_chunks: Sequence[torch.nn.Module],
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    pipeline: PipelinePosition | None,
    dual: bool,
    attention_mask: torch.Tensor | None = None,
) -> Any:
    """One forward of a batch through every chunk of the pipeline, outside the schedules.

    Each rank runs its chunks in virtual-stage order, receiving the previous stage's output and
    sending its own onward with plain point-to-point messages -- for a forward-AD pass the
    primal and the tangent travel as two messages, since a collective on a dual tensor would
    drop the tangent. Returns the last stage's output (logits shard, dual if ``dual``) on the
    ranks holding the last stage, None elsewhere. Call inside ``fwAD.dual_level()`` when
    ``dual``.
    """
    if pipeline is None or pipeline.pp_size == 1:
        if len(model_chunks) != 1:
            raise ValueError("without a pipeline there is exactly one model chunk")
        return model_chunks[0](tokens, position_ids, attention_mask)
    output = None
    last_chunk = len(model_chunks) - 1
    for index, chunk in enumerate(model_chunks):
        first = pipeline.pp_rank == 0 and index == 0
        last = pipeline.pp_rank == pipeline.pp_size - 1 and index == last_chunk
        if not first:
            shape, dtype = _hidden_shape(chunk, tokens), _activation_dtype(chunk)
            primal = torch.empty(shape, dtype=dtype, device=tokens.device)
            dist.recv(primal, src=pipeline.neighbour(-1))
            received = primal
            if dual:
                tangent = torch.empty_like(primal)
                dist.recv(tangent, src=pipeline.neighbour(-1))
                received = fwAD.make_dual(primal, tangent)
            unwrap_model(chunk).set_input_tensor(received)
        output = chunk(tokens, position_ids, attention_mask)
        if not last:
            primal_out, tangent_out = fwAD.unpack_dual(output) if dual else (output, None)
            dist.send(primal_out.contiguous(), dst=pipeline.neighbour(+1))
            if dual:
                if tangent_out is None:
                    raise RuntimeError("a pipeline stage's output lost its forward-mode tangent")
                dist.send(tangent_out.contiguous(), dst=pipeline.neighbour(+1))
            output = None
    return output


@contextmanager
def probe_mode(
    model_chunks: Sequence[torch.nn.Module],
    *,
    targets: Sequence[SketchTarget] = (),
    directions: Mapping[str, LowRankDirection] | None = None,
    parameter_tangents: Mapping[str, torch.Tensor] | None = None,
) -> Iterator[None]:
    """The model as every probe forward runs it: eval mode, no grad, and -- with
    ``directions`` or ``parameter_tangents`` -- a forward-AD dual level with the tangents
    attached (the targets' injection hooks, dual non-target parameters), the forward-AD rules
    installed. Everything is restored on exit, also when the body raises.

    Raises:
        ValueError: malformed directions or parameter tangents, or a target outside the chunks.
    """
    parameter_tangents = dict(parameter_tangents or {})
    dual = directions is not None or bool(parameter_tangents)
    directions = dict(directions or {})
    if parameter_tangents and len(model_chunks) != 1:
        raise ValueError("parameter tangents are supported for a single model chunk only")
    modules_in_chunks = {id(m) for chunk in model_chunks for m in unwrap_model(chunk).modules()}
    for target in targets:
        if id(target.module) not in modules_in_chunks:
            raise ValueError(f"target {target.layer_key} is not a module of the given chunks")
    by_key = _check_directions(targets, directions)
    duals = _dual_parameters(model_chunks[0], targets, parameter_tangents) if dual else []
    if dual:
        install_forward_ad_rules()
    training_flags = [
        (module, module.training) for chunk in model_chunks
        for module in unwrap_model(chunk).modules()
    ]
    handles = []
    try:
        for chunk in model_chunks:
            unwrap_model(chunk).eval()
        with torch.no_grad(), (fwAD.dual_level() if dual else nullcontext()):
            for parameter in duals:
                parameter.module._parameters[parameter.attr] = fwAD.make_dual(
                    parameter.original.detach(), parameter.tangent
                )
            for key, direction in directions.items():
                target = by_key[key]
                handles.append(
                    target.module.register_forward_hook(
                        _injection_hook(target, direction), with_kwargs=True
                    )
                )
            yield
    finally:
        for handle in handles:
            handle.remove()
        for parameter in duals:
            parameter.module._parameters[parameter.attr] = parameter.original
        for module, flag in training_flags:
            module.training = flag


def logit_jvp(
    model_chunks: Sequence[torch.nn.Module],
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    targets: Sequence[SketchTarget],
    directions: Mapping[str, LowRankDirection],
    parameter_tangents: Mapping[str, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    pipeline: PipelinePosition | None = None,
) -> LogitJVP | None:
    """Logits and their exact first-order change along ``directions`` (and parameter tangents),
    through the model's own output layer, for a whole batch at once.

    The reference form: it holds the ``[b, s, V_local]`` logits and tangent. The step control
    streams instead (:mod:`megatron_logra.mcore.kl_probe.stream`: bounded pieces, the output
    layer chunk by chunk); tests compare the two.

    Args:
        model_chunks: this rank's model chunks (one per virtual pipeline stage), optionally
            wrapped (DDP, Float16Module), built with ``parallel_output=True``.
        tokens, position_ids: ``[b, s]`` probe batch, as for the model's forward (every rank of
            the pipeline gets the same batch).
        targets: this rank's sketched linears (e.g. ``LoGRAOptimizer.targets``).
        directions: ``{layer_key: LowRankDirection(left, right)}`` for any subset of
            ``targets``; ``left @ right`` is the local weight shard's update.
        parameter_tangents: optional ``{global parameter name: tangent}`` for non-target
            parameters, each shaped like the local parameter (single chunk only).
        attention_mask: passed to the model (None: the causal mask of the layer spec).
        pipeline: this rank's pipeline position when ``pp > 1``.

    Runs under :func:`probe_mode`. Collectives: the same as a forward plus one per target;
    every rank of the model must call this with the same batch.

    Returns:
        The logits and tangent on the ranks holding the last pipeline stage, None elsewhere.

    Raises:
        ValueError: malformed directions or parameter tangents, or nothing to differentiate.
        RuntimeError: the logits came out without a tangent.
    """
    if not directions and not parameter_tangents:
        raise ValueError("logit_jvp needs at least one direction or parameter tangent")
    with probe_mode(model_chunks, targets=targets, directions=directions,
                    parameter_tangents=parameter_tangents):
        output = staged_forward(model_chunks, tokens, position_ids, pipeline=pipeline,
                                dual=True, attention_mask=attention_mask)
        if output is None:
            return None
        logits, tangent = fwAD.unpack_dual(output)
        if tangent is None:
            raise RuntimeError(LOST_TANGENT)
    return LogitJVP(logits=logits, tangent=tangent)


def probe_logits(
    model_chunks: Sequence[torch.nn.Module],
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    pipeline: PipelinePosition | None = None,
) -> torch.Tensor | None:
    """A plain forward of a batch (eval mode, no grad): this rank's vocab shard of the logits
    on the ranks holding the last pipeline stage, None elsewhere (the reference form of the
    realised-KL pass)."""
    with probe_mode(model_chunks):
        return staged_forward(model_chunks, tokens, position_ids, pipeline=pipeline, dual=False)
