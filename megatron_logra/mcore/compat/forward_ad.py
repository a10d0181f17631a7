"""Forward-mode AD (jvp) rules for the Megatron-Core autograd Functions on a GPT forward.

The predicted-KL step controller needs the first-order change of the logits along a proposed
update, ``dz = J s``, and gets it exactly with one forward pass under
``torch.autograd.forward_ad``. Megatron-Core 0.16.1 defines no ``jvp`` on any of its
``torch.autograd.Function`` subclasses, so a tangent reaching one of them raises
``NotImplementedError``. :func:`install_forward_ad_rules` adds the missing rules at runtime to
every Function a dense local-spec ``GPTModel`` forward passes through:

* the two linear Functions of ``tensor_parallel.layers``: ``LinearWithFrozenWeight`` (frozen
  weights, and any weight that carries a tangent) and
  ``LinearWithGradAccumulationAndAsyncCommunication`` (trainable weights; under sequence
  parallelism it all-gathers its input internally);
* the tensor/sequence-parallel mapping Functions of ``tensor_parallel.mappings``;
* ``utils.MakeViewlessTensor``.

Everything else on that path (embedding lookup, RoPE, core attention, softmax, norms, GeLU/SiLU,
residual adds) is plain torch and carries tangents by itself.

The rule for every communication Function: the tangent of a collective is the same collective
applied to the tangent. Two traps decide the details:

1. A Function whose forward returns an input object as-is (``_CopyToModelParallelRegion``
   always; ``_ReduceFromModelParallelRegion`` always in 0.16.1, because it all-reduces the
   input *in place*; the others at a TP size of one) must return a view of that input's
   tangent. So the reduce rule all-reduces the input tangent in place, mirroring the primal.
2. Tangents never go through Megatron's global memory buffer: a primal output may live in it,
   and a second request for the same buffer would overwrite it.
3. A primal output in that buffer is a *view* of it whenever the request is smaller than the
   buffer (the streamed KL probe's pieces are shorter than the training microbatches that sized
   it), and forward AD wants a view output's tangent laid out as a view too, which a freshly
   gathered tangent is not (PyTorch's "tangent have the same layout as primal" assertion, seen
   with the MoE all-gather dispatcher). While a dual level is open, the wrapped forward returns
   a copy of an output that views a tensor other than its inputs.

Inputs without a tangent (the weights, whose update enters through the targets' hooks) reach
every rule as None: the wrapped forward turns off torch's materialisation of absent tangents as
zeros, which would cost each linear a dense matmul by a zero weight tangent.

Installation is explicit (nothing happens on import), idempotent and process-wide. It changes
nothing for ordinary training: the wrapped ``forward`` calls the original one and keeps
references to its arguments for the rule only while a forward-AD dual level is open, so outside
one the same kernels run on the same tensors and gradients are bit-identical. (A forward with
grad mode on *inside* a dual level keeps those references as long as the graph for Functions
whose jvp never ran, e.g. ``LinearWithFrozenWeight``'s input; the probe runs under no_grad.)

MoE adds two Functions, the router's gating linear and the expert all-to-all; their rules live in
:mod:`megatron_logra.mcore.compat.moe_forward_ad` and are installed with these.

Not covered: the vocab-parallel cross entropy, activation recomputation and
the fused kernels of Transformer Engine/apex get no rule; a probe forward that reaches them
raises ``NotImplementedError`` (loudly, never a silent zero).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
from megatron.core import utils as mcore_utils
from megatron.core.tensor_parallel import layers as mcore_layers
from megatron.core.tensor_parallel import mappings as mcore_mappings
from megatron.core.transformer.moe import moe_utils

from megatron_logra.mcore.compat.moe_forward_ad import all_to_all_rule, router_gating_rule

logger = logging.getLogger(__name__)

# Attributes the wrapped forward leaves on ``ctx`` for the rule (only inside a dual level).
_INPUTS_ATTR = "_logra_fad_inputs"
_AS_IS_ATTR = "_logra_fad_returned_input"

Rule = Callable[[Any, tuple[Any, ...], tuple[torch.Tensor | None, ...]], torch.Tensor | None]


def _dual_level_open() -> bool:
    """Whether a ``forward_ad.dual_level`` is active in this thread of control.

    torch keeps this as a module attribute of ``torch.autograd.forward_ad``; its presence is
    checked once by :func:`install_forward_ad_rules`.
    """
    return fwAD._current_level >= 0


def _arg(inputs: tuple[Any, ...], index: int, default: Any) -> Any:
    """A positional forward argument that Megatron may leave at its default."""
    return inputs[index] if len(inputs) > index else default


# ----------------------------------------------------------------------------- mapping rules


def _copy_rule(ctx: Any, inputs: tuple[Any, ...], tangents: tuple[torch.Tensor | None, ...]):
    # Identity forward (the all-reduce is in backward): the tangent passes unchanged.
    return tangents[0]


def _reduce_rule(ctx: Any, inputs: tuple[Any, ...], tangents: tuple[torch.Tensor | None, ...]):
    primal, group = inputs[0], inputs[1]
    tangent = tangents[0]
    if group.size() == 1:
        return tangent
    if not primal.is_contiguous():
        # Megatron 0.16.1 all-reduces ``input_.contiguous()`` and returns ``input_``: for a
        # non-contiguous input the reduced copy is discarded and the output is the unreduced
        # input. The tangent of that function is the unreduced tangent.
        return tangent
    if tangent.is_contiguous():
        dist.all_reduce(tangent, group=group)
    else:
        reduced = tangent.contiguous()
        dist.all_reduce(reduced, group=group)
        tangent.copy_(reduced)
    # In place, as the primal: the output is the input object, so its tangent must be a view of
    # the input's tangent (trap 1).
    return tangent


def _scatter_last_rule(ctx: Any, inputs: tuple[Any, ...], tangents: tuple[Any, ...]):
    return mcore_mappings._split_along_last_dim(tangents[0], inputs[1])


def _gather_last_rule(ctx: Any, inputs: tuple[Any, ...], tangents: tuple[Any, ...]):
    return mcore_mappings._gather_along_last_dim(tangents[0], inputs[1])


def _reduce_scatter_last_rule(ctx: Any, inputs: tuple[Any, ...], tangents: tuple[Any, ...]):
    return mcore_mappings._reduce_scatter_along_last_dim(tangents[0], inputs[1])


def _scatter_first_rule(ctx: Any, inputs: tuple[Any, ...], tangents: tuple[Any, ...]):
    return mcore_mappings._split_along_first_dim(tangents[0], inputs[1])


def _gather_first_rule(ctx: Any, inputs: tuple[Any, ...], tangents: tuple[Any, ...]):
    # forward(input_, group, tensor_parallel_output_grad=True, output_split_sizes=None,
    #         use_global_buffer=False)
    tangent, group = tangents[0], inputs[1]
    if group.size() == 1:
        return tangent
    return mcore_mappings._gather_along_first_dim(
        tangent.contiguous(), group, _arg(inputs, 3, None), use_global_buffer=False
    )


def _reduce_scatter_first_rule(ctx: Any, inputs: tuple[Any, ...], tangents: tuple[Any, ...]):
    # forward(input_, group, input_split_sizes=None, use_global_buffer=False)
    tangent, group = tangents[0], inputs[1]
    if group.size() == 1:
        return tangent
    return mcore_mappings._reduce_scatter_along_first_dim(
        tangent.contiguous(), group, _arg(inputs, 2, None), use_global_buffer=False
    )


def _viewless_rule(ctx: Any, inputs: tuple[Any, ...], tangents: tuple[Any, ...]):
    # The primal output is a new tensor object aliasing the input's storage; the tangent aliases
    # the input's tangent the same way (no copy of a hidden-state-sized tensor).
    return tangents[0]


# ----------------------------------------------------------------------------- linear rules


def _linear_tangent(
    total_input: torch.Tensor,
    weight: torch.Tensor,
    input_tangent: torch.Tensor | None,
    weight_tangent: torch.Tensor | None,
    bias_tangent: torch.Tensor | None,
) -> torch.Tensor | None:
    """``d(X W^T + b) = dX W^T + X dW^T + db``."""
    out = None
    if input_tangent is not None:
        out = torch.matmul(input_tangent, weight.t())
    if weight_tangent is not None:
        term = torch.matmul(total_input, weight_tangent.t())
        out = term if out is None else out + term
    if bias_tangent is not None:
        out = bias_tangent.expand_as(out) if out is None else out + bias_tangent
    return out


def _frozen_linear_rule(ctx: Any, inputs: tuple[Any, ...], tangents: tuple[Any, ...]):
    # forward(input, weight, bias, allreduce_dgrad, tp_group): under sequence parallelism the
    # caller has already gathered the input (through _GatherFromSequenceParallelRegion).
    return _linear_tangent(inputs[0], inputs[1], tangents[0], tangents[1], tangents[2])


def _async_linear_rule(ctx: Any, inputs: tuple[Any, ...], tangents: tuple[Any, ...]):
    # forward(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
    #         sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group)
    total_input, weight = inputs[0], inputs[1]
    input_tangent, weight_tangent, bias_tangent = tangents[0], tangents[1], tangents[2]
    if inputs[5]:
        # The primal all-gathered its sequence shard into the global buffer; gather into fresh
        # tensors here (trap 2), the same layout as _gather_along_first_dim.
        group = inputs[8]
        if input_tangent is not None:
            input_tangent = mcore_mappings._gather_along_first_dim(
                input_tangent.contiguous(), group, use_global_buffer=False
            )
        if weight_tangent is not None:
            total_input = mcore_mappings._gather_along_first_dim(
                total_input.contiguous(), group, use_global_buffer=False
            )
    return _linear_tangent(total_input, weight, input_tangent, weight_tangent, bias_tangent)


# ----------------------------------------------------------------------------- installation


@dataclass(frozen=True)
class _Target:
    owner: Any
    name: str
    rule: Rule


def _targets() -> list[_Target]:
    m, layers = mcore_mappings, mcore_layers
    return [
        _Target(layers, "LinearWithFrozenWeight", _frozen_linear_rule),
        _Target(layers, "LinearWithGradAccumulationAndAsyncCommunication", _async_linear_rule),
        _Target(m, "_CopyToModelParallelRegion", _copy_rule),
        _Target(m, "_ReduceFromModelParallelRegion", _reduce_rule),
        _Target(m, "_ScatterToModelParallelRegion", _scatter_last_rule),
        _Target(m, "_GatherFromModelParallelRegion", _gather_last_rule),
        _Target(m, "_ScatterToSequenceParallelRegion", _scatter_first_rule),
        _Target(m, "_GatherFromSequenceParallelRegion", _gather_first_rule),
        _Target(m, "_ReduceScatterToSequenceParallelRegion", _reduce_scatter_first_rule),
        _Target(m, "_AllGatherFromTensorParallelRegion", _gather_last_rule),
        _Target(m, "_ReduceScatterToTensorParallelRegion", _reduce_scatter_last_rule),
        _Target(mcore_utils, "MakeViewlessTensor", _viewless_rule),
        _Target(m, "_AllToAll", all_to_all_rule),
        _Target(moe_utils, "RouterGatingLinearFunction", router_gating_rule),
    ]


# class -> its original ``forward`` staticmethod object, for every class we patched.
_installed: dict[type, Any] = {}


def _views_other_than(output: Any, args: tuple[Any, ...]) -> bool:
    """Whether ``output`` is a view of a tensor that is none of ``args`` (nor their bases)."""
    if not isinstance(output, torch.Tensor) or output._base is None:
        return False
    bases = {id(a) for a in args if isinstance(a, torch.Tensor)}
    bases |= {id(a._base) for a in args if isinstance(a, torch.Tensor) and a._base is not None}
    return id(output._base) not in bases


def _wrapped_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(ctx: Any, *args: Any) -> Any:
        output = original(ctx, *args)
        if _dual_level_open():
            # An input without a tangent reaches the rule as None, not as zeros: by default
            # torch materialises it, and a linear's rule would then spend a full matmul on
            # ``X 0^T`` for its weight (a third of a probe pass's matmul time, measured).
            # Every rule treats None as zero; with one output per Function, backward (grad
            # mode on inside a dual level) still gets its one gradient.
            ctx.set_materialize_grads(False)
            # Inside forward the tangents are invisible; keep the primal arguments for the rule,
            # which torch calls right after this forward returns.
            setattr(ctx, _INPUTS_ATTR, args)
            as_is = any(output is arg for arg in args)
            setattr(ctx, _AS_IS_ATTR, as_is)
            if not as_is and _views_other_than(output, args):
                output = output.clone()  # trap 3: a view of the global memory buffer
        return output

    return forward


def _jvp_from_rule(name: str, rule: Rule) -> Callable[..., Any]:
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> torch.Tensor | None:
        inputs = getattr(ctx, _INPUTS_ATTR, None)
        if inputs is None:
            raise RuntimeError(
                f"{name}.jvp ran without the primal inputs its forward should have kept; the "
                "forward-AD rules were installed while this forward was already running"
            )
        # Drop the references now: with grad mode on, ctx lives as long as the graph.
        delattr(ctx, _INPUTS_ATTR)
        # The rules are tangent arithmetic, never part of a backward graph. Without no_grad,
        # tangents of requires-grad weights would record history and gloo's in-place
        # collectives on them would be refused.
        with torch.no_grad():
            out = rule(ctx, inputs, tangents)
        if out is not None and getattr(ctx, _AS_IS_ATTR):
            # Trap 1: an output that is an input object needs a view of the input tangent.
            out = out.view_as(out)
        return out

    return jvp


def install_forward_ad_rules() -> None:
    """Add ``jvp`` rules to Megatron-Core's autograd Functions (idempotent).

    Call once per process before a forward-mode probe (``logit_jvp`` does). Raises RuntimeError
    if this torch no longer exposes the dual-level state the rules rely on, or if a Function
    already defines its own ``jvp`` (a newer Megatron-Core: review before overriding it).
    """
    if _installed:
        return
    if not isinstance(getattr(fwAD, "_current_level", None), int):
        raise RuntimeError(
            "torch.autograd.forward_ad._current_level is missing in this torch; the forward-AD "
            "rules for Megatron-Core need it to know when a dual level is open"
        )
    targets = _targets()
    classes = []
    for target in targets:
        cls = getattr(target.owner, target.name, None)
        if cls is None:
            raise RuntimeError(
                f"{target.owner.__name__}.{target.name} does not exist in this Megatron-Core; "
                "the forward-AD rules were written for megatron-core 0.16.1"
            )
        if "jvp" in cls.__dict__:
            raise RuntimeError(
                f"{target.owner.__name__}.{target.name} already defines jvp; this Megatron-Core "
                "has its own forward-mode rules, review them before installing ours"
            )
        classes.append(cls)
    for target, cls in zip(targets, classes, strict=True):
        original = cls.__dict__["forward"]
        _installed[cls] = original
        cls.forward = staticmethod(_wrapped_forward(original.__func__))
        cls.jvp = staticmethod(_jvp_from_rule(target.name, target.rule))
    logger.info("forward-mode AD rules installed on %d Megatron-Core Functions", len(classes))


def forward_ad_rules_installed() -> bool:
    return bool(_installed)


def patched_function_names() -> list[str]:
    """Names of the Functions that carry our rules (empty when not installed)."""
    return sorted(cls.__name__ for cls in _installed)
