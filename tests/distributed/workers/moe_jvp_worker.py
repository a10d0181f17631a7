"""The KL probe's forward-mode JVP through Megatron's MoE layer, on one process (torchrun).

The tiny narrow GPT with an MoE layer in both decoder layers (4 experts, top-2, dropless), in
fp64. Targets: every linear (attention, each routed expert's fc1 / fc2 under its global index);
their weights frozen as in LoGRA training. Directions as in ``logit_jvp_worker``.

Routing is piecewise constant in the weights: top-k selects experts by comparing router logits,
so the selection (the routing map) has a zero tangent almost everywhere; the routing
*probabilities* (a softmax over the selected logits) are smooth and do carry a tangent through
the router, and the experts' outputs carry theirs. The forward-AD tangent is compared with fp64
central differences at two steps, inside one piece: the worker checks that the perturbed runs
route every token to the same experts as the unperturbed one (otherwise the difference quotient
would measure a jump, not the derivative).

Writes ``moe_jvp.json``: the tangent's relative error against each difference quotient, whether
the routing maps agree, and whether the probe's logits are bit-identical to a plain forward.
"""

from __future__ import annotations

import torch
from harness import Case, run_worker
from logit_jvp_worker import (
    VOCAB,
    directions_for,
    perturbed_logits,
    probe_batch,
    rel_err,
)
from megatron.core.transformer.moe.router import TopKRouter

from megatron_logra.config import load_config
from megatron_logra.mcore.kl_probe.logit_jvp import logit_jvp
from megatron_logra.mcore.models.gpt import build_model
from megatron_logra.mcore.models.targets import TARGET_PATHS, find_targets
from tests.presets import NARROW, SWIGLU_RMSNORM_NO_BIAS, tiny_gpt

SEQ = 16
# Smaller than the dense worker's (1e-3, 1e-4): at 1e-3 a token's top-2 already flips (measured),
# and a difference quotient across a routing jump measures the jump. fp64 roundoff at 1e-5 is
# ~1e-11 relative, far below the truncation error.
FD_STEPS = (1e-4, 1e-5)
MOE = ["model.num_moe_experts=4", "model.moe_ffn_hidden_size=16", "model.moe_router_topk=2"]


_SOFTMAX = torch.softmax


def _softmax_in_input_dtype(input, dim, dtype=None):  # noqa: A002 - torch's signature
    """torch.softmax that keeps an fp64 input in fp64: Megatron's router computes its scores
    with ``dtype=torch.float32`` whatever the model's dtype, which would put an fp32 rounding
    floor (~1e-7 / step) under an fp64 difference quotient. Installed for this fp64 reference
    only; the probe and the differences both run through it."""
    if input.dtype == torch.float64:
        dtype = torch.float64
    return _SOFTMAX(input, dim, dtype=dtype)


def cfg_for(args, world: int):
    overrides = ["parallel.device=cpu", "parallel.tp=1", *tiny_gpt(**NARROW, seq_length=SEQ),
                 *SWIGLU_RMSNORM_NO_BIAS, *MOE, "train.micro_batch_size=1",
                 "train.global_batch_size=1"]
    return load_config(None, overrides).resolved(world)


def _routing_maps(model) -> list:
    """A recorder of every router's routing map (which experts each token goes to)."""
    maps: list = []
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(lambda m, a, out: maps.append(out[1].clone()))
    return maps


def measure(args, cfg, groups):
    torch.softmax = _softmax_in_input_dtype
    model = build_model(cfg, groups, vocab_size=VOCAB).to(torch.float64)
    model.eval()
    targets = find_targets([model], list(TARGET_PATHS), tp_rank=0)
    for target in targets:
        target.weight.requires_grad_(False)
    maps = _routing_maps(model)
    tokens, position_ids, _ = probe_batch(2)
    directions = directions_for(targets, groups, torch.float64)
    result = logit_jvp([model], tokens, position_ids, targets=targets, directions=directions)
    maps.clear()
    with torch.no_grad():
        plain = model(tokens, position_ids, None)
    base_maps = list(maps)
    report = {
        "expert_targets": sum(t.expert for t in targets),
        "logits_bit_identical": bool(torch.equal(result.logits, plain)),
        "tangent_norm": float(result.tangent.norm()),
        "fd": {},
    }
    for step in FD_STEPS:
        maps.clear()
        up = perturbed_logits(model, targets, directions, {}, tokens, position_ids, step)
        up_maps = list(maps)
        maps.clear()
        down = perturbed_logits(model, targets, directions, {}, tokens, position_ids, -step)
        down_maps = list(maps)
        same = all(torch.equal(a, b) for a, b in zip(base_maps, up_maps, strict=True)) and all(
            torch.equal(a, b) for a, b in zip(base_maps, down_maps, strict=True))
        report["fd"][str(step)] = {
            "rel_err": rel_err(result.tangent, (up - down) / (2 * step)),
            "routing_unchanged": same,
        }
    return report


run_worker({"moe_jvp": Case(cfg_for, measure, output="moe_jvp.json", world_sizes=(1,))})
