"""Forward-mode AD (jvp) rules for the two Megatron-Core autograd Functions on an MoE forward.

Added to the rules of :mod:`megatron_logra.mcore.compat.forward_ad` (installed with them):

* ``moe_utils.RouterGatingLinearFunction`` -- the router's ``logits = X W_r^T (+ b)`` computed in
  the routing dtype: ``d logits = dX W_r^T + X dW_r^T + db``, in that dtype, shaped like the
  output. Top-k then *selects* experts by comparing these logits: the selection is piecewise
  constant (its tangent is zero almost everywhere), while the routing probabilities, a softmax
  over the selected logits, are plain torch and carry the logits' tangent by themselves.
* ``mappings._AllToAll`` -- the expert-parallel dispatch / combine: the tangent of an all-to-all
  is the same all-to-all (same split sizes) of the tangent; at an expert-parallel size of one the
  primal returns its input as-is, and the rule then returns a view of the input tangent (trap 1
  of ``forward_ad``). Tested across ranks by the KL controller at EP=2 == EP=1
  (tests/e2e/test_moe.py).

Everything else on the MoE path (top-k, softmax, the permutation by ``index_select`` /
``scatter_add``, the experts' linears through the dense linear rules) is plain torch or covered.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def router_gating_rule(ctx: Any, inputs: tuple[Any, ...], tangents: tuple[Any, ...]):
    # forward(inp, weight, bias, router_dtype) -> [*inp.shape[:-1], experts]
    inp, weight, bias, router_dtype = inputs[0], inputs[1], inputs[2], inputs[3]
    d_inp, d_weight, d_bias = tangents[0], tangents[1], tangents[2]
    flat = inp.reshape(-1, inp.shape[-1]).to(router_dtype)
    out = None
    if d_inp is not None:
        out = d_inp.reshape(-1, inp.shape[-1]).to(router_dtype) @ weight.to(router_dtype).t()
    if d_weight is not None:
        term = flat @ d_weight.to(router_dtype).t()
        out = term if out is None else out + term
    if d_bias is not None and bias is not None:
        term = d_bias.to(router_dtype).expand(flat.shape[0], -1)
        out = term if out is None else out + term
    return None if out is None else out.view(*inp.shape[:-1], -1)


def all_to_all_rule(ctx: Any, inputs: tuple[Any, ...], tangents: tuple[Any, ...]):
    # forward(group, input, output_split_sizes, input_split_sizes)
    group, primal, output_splits, input_splits = inputs
    tangent = tangents[1]
    if tangent is None:
        return None
    if group.size() == 1:
        return tangent
    tangent = tangent.contiguous()
    if output_splits is None:
        out = torch.empty_like(tangent)
    else:
        out = tangent.new_empty([int(sum(output_splits)), *tangent.shape[1:]])
    dist.all_to_all_single(out, tangent, output_split_sizes=output_splits,
                           input_split_sizes=input_splits, group=group)
    return out
