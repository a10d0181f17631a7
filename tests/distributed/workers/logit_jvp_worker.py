"""Measure the forward-mode logit probe on real Megatron-Core GPT models over gloo.

Run under torchrun with 1 process (``--case tp1``: the reference) or 2 processes (``--case tp2``:
TP=2, with and without sequence parallelism, compared against the reference the 1-process run
saved in ``--out``). Rank 0 writes ``tp1.json`` or ``tp2.json`` to ``--out``; the pytest side
asserts the claims.

Two probe cases, each built in fp32 and as an fp64 copy of the same weights:

* ``targets``: the LoGRA training route -- target weights frozen (Megatron's
  LinearWithFrozenWeight), GeLU, LayerNorm, RoPE, micro-batch 2, only low-rank target directions;
* ``all_params``: target weights trainable (Megatron's async-allreduce linear), SwiGLU (strided
  fc1 shards), RMSNorm, learned positions, micro-batch 1 (Megatron's MakeViewlessTensor), target
  directions plus a tangent on every non-target parameter (embeddings, norms, biases, output).

Directions are layout independent: ``D [m, k]`` from a generator seeded by the layer key and ``A``
from :mod:`megatron_logra.projection`, both full size and sliced per rank the way Megatron slices
the weight (column-parallel: rows of D, all of A; row-parallel: all of D, columns of A).

Measurements (all errors are relative Frobenius norms):

* TP=1 fp64: the forward-AD tangent against central finite differences at two step sizes;
* TP=1 fp32: the fp32 tangent against the fp64 tangent of the same weights;
* primal logits of the probe against a plain forward (bit-identical);
* TP=2 (+SP): the vocab-gathered tangent, logits and the vocab-parallel predicted KL against TP=1;
  the vocab-parallel predicted and exact KL against the full-vocabulary functions on the
  gathered logits; ``TokenSum.all_reduced`` over the TP group;
* gradients of a training forward/backward before the rules are installed, after installing
  them, and after a probe ran (bit-identical);
* the probe's error paths (malformed input, a tangent dropped on the way to the logits).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch
import torch.distributed as dist
from harness import Case, raised_errors, run_worker
from kl_stream_steps import layout_steps, tp1_steps

from megatron_logra.config import load_config
from megatron_logra.kl import (
    exact_kl,
    exact_kl_vocab_parallel,
    predicted_kl,
    predicted_kl_vocab_parallel,
)
from megatron_logra.mcore.compat.forward_ad import (
    forward_ad_rules_installed,
    install_forward_ad_rules,
    patched_function_names,
)
from megatron_logra.mcore.kl_probe.logit_jvp import LowRankDirection, logit_jvp
from megatron_logra.mcore.kl_probe.stream import layout_pieces, output_layer_chunks, run_pieces
from megatron_logra.mcore.models.gpt import build_model
from megatron_logra.mcore.models.sharding import (
    full_shape,
    global_named_parameters,
    partition_of,
    shard_from_full,
)
from megatron_logra.mcore.models.targets import TARGET_PATHS, find_targets
from megatron_logra.probe_batch import ProbeBatch
from megatron_logra.projection import generate_projection, projection_key
from tests.layouts import LOGIT_JVP_LAYOUTS, WORKER_LAYOUTS, tp_sp
from tests.presets import NARROW, tiny_gpt

VOCAB = 100  # padded to 128 by the model: TP=2 shards are 64 wide, the second half padding-heavy
SEQ = 16
DIRECTION_RANK = 4
TEMPERATURE = 0.8
FD_STEPS = (1e-3, 1e-4)
# Step used to compare the exact KL between the vocab-parallel and full forms.
EXACT_KL_STEP = 0.05
# Counted positions per output-layer chunk of the streamed probe here: several chunks per row.
STREAM_CHUNK = 5

CASES: dict[str, dict[str, Any]] = {
    "targets": {
        "overrides": ["model.activation=gelu", "model.normalization=LayerNorm",
                      "model.position_embedding=rope"],
        "freeze_targets": True, "batch": 2, "parameter_tangents": False,
    },
    "all_params": {
        "overrides": ["model.activation=swiglu", "model.normalization=RMSNorm",
                      "model.position_embedding=learned_absolute"],
        "freeze_targets": False, "batch": 1, "parameter_tangents": True,
    },
}


def build_cfg(tp: int, sp: bool, world: int, case_overrides: list[str]):
    overrides = [
        "parallel.device=cpu", *tp_sp(tp, sp), *tiny_gpt(**NARROW, seq_length=SEQ),
        "model.add_bias_linear=true", "train.micro_batch_size=1", "train.global_batch_size=2",
        *case_overrides,
    ]
    return load_config(None, overrides).resolved(world)


def key_seed(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 2


def rel_err(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.double() - reference.double()).norm() / reference.double().norm())


def scalar_rel_err(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference)


def probe_batch(batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=generator)
    position_ids = torch.arange(SEQ)[None].expand(batch, SEQ).contiguous()
    # Positions whose KL counts (as generated-token positions would be chosen by the trainer).
    mask = torch.rand(batch, SEQ, generator=generator) < 0.7
    return tokens, position_ids, mask


def build_models(cfg, groups, case: dict[str, Any]):
    """The fp32 model and an fp64 copy of the same weights (exact: fp32 -> fp64 is lossless)."""
    models = {}
    for dtype in (torch.float32, torch.float64):
        model = build_model(cfg, groups, vocab_size=VOCAB).to(dtype)
        targets = find_targets([model], list(TARGET_PATHS), tp_rank=groups.tp_rank)
        if case["freeze_targets"]:
            for target in targets:
                target.weight.requires_grad_(False)
        models[dtype] = (model, targets)
    return models


def directions_for(targets, groups, dtype: torch.dtype) -> dict[str, LowRankDirection]:
    """Layout-independent low-rank directions, made in fp32 (the fp64 run upcasts them)."""
    out = {}
    for target in targets:
        key = projection_key(5, 0, target.layer_key)
        dim, stride = partition_of(target.weight)
        if target.parallel_kind == "column":
            full_rows = target.rows * groups.tp_size
            right = generate_projection(key, DIRECTION_RANK, 0, target.in_features, "gaussian")
        else:
            full_rows = target.rows
            right = generate_projection(
                key, DIRECTION_RANK, target.col_start, target.col_end, "gaussian"
            )
        generator = torch.Generator().manual_seed(key_seed(target.layer_key))
        full_left = 0.05 * torch.randn(full_rows, DIRECTION_RANK, generator=generator)
        if target.parallel_kind == "column":
            left = shard_from_full(full_left, dim, stride, groups.tp_rank, groups.tp_size)
        else:
            left = full_left
        out[target.layer_key] = LowRankDirection(
            left.contiguous().to(dtype), right.contiguous().to(dtype)
        )
    return out


def parameter_tangents_for(model, targets, groups, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    target_ids = {id(target.weight) for target in targets}
    out = {}
    for name, param in global_named_parameters(model):
        if id(param) in target_ids:
            continue
        generator = torch.Generator().manual_seed(key_seed("tangent|" + name))
        full = 0.05 * torch.randn(full_shape(param, groups.tp_size), generator=generator)
        dim, stride = partition_of(param)
        shard = shard_from_full(full, dim, stride, groups.tp_rank, groups.tp_size)
        out[name] = shard.contiguous().to(dtype)
    return out


@torch.no_grad()
def perturbed_logits(model, targets, directions, parameter_tangents, tokens, position_ids, step):
    """Logits with every target weight moved by ``step * left @ right`` and every other tangent
    parameter by ``step * tangent``; weights restored exactly from copies afterwards."""
    params = dict(global_named_parameters(model))
    saved = {}
    for target in targets:
        saved[id(target.weight)] = (target.weight, target.weight.detach().clone())
        left, right = directions[target.layer_key]
        target.weight.add_(step * (left @ right))
    for name, tangent in parameter_tangents.items():
        saved[id(params[name])] = (params[name], params[name].detach().clone())
        params[name].add_(step * tangent)
    logits = model(tokens, position_ids, None)
    for param, original in saved.values():
        param.copy_(original)
    return logits


def gather_vocab(shard: torch.Tensor, group) -> torch.Tensor:
    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, shard.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def training_gradients(model, tokens, position_ids) -> dict[str, torch.Tensor]:
    """Gradients of one training forward/backward (per-token LM loss, summed)."""
    model.zero_grad(set_to_none=True)
    labels = torch.roll(tokens, shifts=-1, dims=1)
    loss = model(tokens, position_ids, None, labels=labels)
    loss.sum().backward()
    return {
        name: param.grad.detach().clone()
        for name, param in global_named_parameters(model) if param.grad is not None
    }


def gradient_check(cfg, groups) -> dict[str, Any]:
    """Training gradients without the rules, with them, and after a probe forward."""
    if forward_ad_rules_installed():
        raise RuntimeError("the gradient check must run before anything installs the rules")
    model = build_model(cfg, groups, vocab_size=VOCAB)
    targets = find_targets([model], list(TARGET_PATHS), tp_rank=groups.tp_rank)
    # Half the targets frozen: training then runs both of Megatron's linear Functions.
    for target in targets:
        if target.parallel_kind == "column":
            target.weight.requires_grad_(False)
    tokens, position_ids, _ = probe_batch(2)
    before = training_gradients(model, tokens, position_ids)
    install_forward_ad_rules()
    install_forward_ad_rules()  # idempotent
    installed = training_gradients(model, tokens, position_ids)
    params_before = [param for _, param in global_named_parameters(model)]
    flags_before = [module.training for module in model.modules()]
    logit_jvp(
        [model], tokens, position_ids, targets=targets,
        directions=directions_for(targets, groups, torch.float32),
    )
    params_after = [param for _, param in global_named_parameters(model)]
    flags_after = [module.training for module in model.modules()]
    after_probe = training_gradients(model, tokens, position_ids)
    return {
        "num_grads": len(before),
        "patched_functions": patched_function_names(),
        "identical_with_rules": sorted(before) == sorted(installed)
        and all(torch.equal(before[name], installed[name]) for name in before),
        "identical_after_probe": sorted(before) == sorted(after_probe)
        and all(torch.equal(before[name], after_probe[name]) for name in before),
        "parameters_restored": all(
            a is b for a, b in zip(params_before, params_after, strict=True)
        ),
        "training_flags_restored": flags_before == flags_after and flags_before[0],
    }


def probe(model, targets, groups, case, dtype):
    tokens, position_ids, mask = probe_batch(case["batch"])
    directions = directions_for(targets, groups, dtype)
    tangents = (
        parameter_tangents_for(model, targets, groups, dtype) if case["parameter_tangents"] else {}
    )
    result = logit_jvp(
        [model], tokens, position_ids, targets=targets, directions=directions,
        parameter_tangents=tangents,
    )
    with torch.no_grad():
        plain = model(tokens, position_ids, None)
    return result, directions, tangents, tokens, position_ids, mask, torch.equal(
        result.logits, plain
    )


def streamed(model, targets, directions, tokens, position_ids, mask):
    """The streamed probe's logits and tangent at the counted positions (rows in order): each
    row a piece, the output layer in chunks of STREAM_CHUNK positions."""
    pieces = layout_pieces(ProbeBatch.from_rows(tokens, position_ids, mask), multiple=1,
                           align_group=None, same_lengths=False, device=tokens.device)
    logits, tangents = [], []

    def consume(index, final):
        for z, dz in output_layer_chunks(final, chunk_positions=STREAM_CHUNK):
            logits.append(z)
            tangents.append(dz)

    run_pieces([model], pieces, consume, pipeline=None, targets=targets, directions=directions,
               holds_output=True)
    return torch.cat(logits), torch.cat(tangents)


def run_reference(args, cfg, groups) -> dict[str, Any]:
    report: dict[str, Any] = {"gradients": gradient_check(cfg, groups), "cases": {}}
    saved: dict[str, Any] = {}
    for name, case in CASES.items():
        cfg = build_cfg(1, False, 1, case["overrides"])
        models = build_models(cfg, groups, case)
        entry: dict[str, Any] = {}
        tangent64 = None
        for dtype in (torch.float64, torch.float32):
            model, targets = models[dtype]
            result, directions, tangents, tokens, position_ids, mask, identical = probe(
                model, targets, groups, case, dtype
            )
            tag = "fp64" if dtype == torch.float64 else "fp32"
            entry[f"primal_identical_{tag}"] = identical
            if not tangents:
                stream_logits, stream_tangent = streamed(model, targets, directions, tokens,
                                                         position_ids, mask)
                entry[f"streamed_logits_rel_err_{tag}"] = rel_err(stream_logits,
                                                                  result.logits[mask])
                entry[f"streamed_tangent_rel_err_{tag}"] = rel_err(stream_tangent,
                                                                   result.tangent[mask])
            kl = predicted_kl(
                result.logits, result.tangent, temperature=TEMPERATURE, mask=mask,
                vocab_size=VOCAB,
            )
            entry[f"predicted_kl_{tag}"] = kl.mean()
            saved[f"{name}/{tag}"] = {
                "logits": result.logits, "tangent": result.tangent, "predicted_kl": kl.mean(),
            }
            if dtype == torch.float64:
                tangent64 = result.tangent
                fd_errors = []
                for step in FD_STEPS:
                    plus = perturbed_logits(
                        model, targets, directions, tangents, tokens, position_ids, step
                    )
                    minus = perturbed_logits(
                        model, targets, directions, tangents, tokens, position_ids, -step
                    )
                    fd_errors.append(rel_err(result.tangent, (plus - minus) / (2 * step)))
                entry["fd_steps"] = list(FD_STEPS)
                entry["fd_rel_err"] = fd_errors
                if not tangents:
                    # The streamed probe (LoGRA's route: target directions only).
                    _, stream_tangent = streamed(model, targets, directions, tokens,
                                                 position_ids, mask)
                    entry["streamed_fd_rel_err"] = [
                        rel_err(stream_tangent, ((perturbed_logits(
                            model, targets, directions, tangents, tokens, position_ids, step)
                            - perturbed_logits(model, targets, directions, tangents, tokens,
                                               position_ids, -step)) / (2 * step))[mask])
                        for step in FD_STEPS
                    ]
                entry["tangent_norm_over_logit_norm"] = float(
                    result.tangent.norm() / result.logits.norm()
                )
            else:
                entry["fp32_vs_fp64_tangent_rel_err"] = rel_err(result.tangent, tangent64)
                entry["fp32_vs_fp64_predicted_kl_rel_err"] = scalar_rel_err(
                    entry["predicted_kl_fp32"], entry["predicted_kl_fp64"]
                )
        report["cases"][name] = entry
    report["errors"] = error_paths(groups)
    torch.save(saved, args.out / "reference.pt")
    start = time.perf_counter()
    report["kl_stream"] = tp1_steps()
    report["kl_stream_seconds"] = time.perf_counter() - start
    return report


def error_paths(groups) -> dict[str, str]:
    """The exception each malformed call raises, as ``Type: message``."""
    cfg = build_cfg(1, False, 1, CASES["targets"]["overrides"])
    model = build_model(cfg, groups, vocab_size=VOCAB)
    targets = find_targets([model], list(TARGET_PATHS), tp_rank=groups.tp_rank)
    directions = directions_for(targets, groups, torch.float32)
    tokens, position_ids, _ = probe_batch(1)
    first = targets[0]
    calls = {
        "unknown_layer": lambda: logit_jvp(
            [model], tokens, position_ids, targets=targets,
            directions={"decoder.layers.9.mlp.linear_fc1": directions[first.layer_key]},
        ),
        "bad_shape": lambda: logit_jvp(
            [model], tokens, position_ids, targets=targets,
            directions={first.layer_key: LowRankDirection(
                directions[first.layer_key].left[:-1], directions[first.layer_key].right)},
        ),
        "target_as_parameter": lambda: logit_jvp(
            [model], tokens, position_ids, targets=targets, directions={},
            parameter_tangents={f"{first.layer_key}.weight": torch.zeros_like(first.weight)},
        ),
        "nothing_to_probe": lambda: logit_jvp(
            [model], tokens, position_ids, targets=targets, directions={},
        ),
        "two_chunks": lambda: logit_jvp(
            [model, model], tokens, position_ids, targets=targets, directions=directions,
        ),
    }
    # A real operation that drops tangents (detach) between the layers and the logits.
    def lost() -> None:
        handle = model.decoder.final_layernorm.register_forward_hook(
            lambda module, args, output: output.detach()
        )
        try:
            logit_jvp([model], tokens, position_ids, targets=targets, directions=directions)
        finally:
            handle.remove()

    calls["tangent_lost"] = lost
    return raised_errors(calls)


def run_layouts(args, cfg, groups) -> dict[str, Any]:
    reference = torch.load(args.out / "reference.pt")
    sp_cfg = build_cfg(2, True, 2, CASES["targets"]["overrides"])
    report: dict[str, Any] = {"gradients_tp2_sp": gradient_check(sp_cfg, groups), "layouts": {}}
    for layout in LOGIT_JVP_LAYOUTS:
        _, tp, sp = WORKER_LAYOUTS[layout]
        layout_report: dict[str, Any] = {}
        for name, case in CASES.items():
            cfg = build_cfg(tp, sp, 2, case["overrides"])
            models = build_models(cfg, groups, case)
            entry: dict[str, Any] = {}
            for dtype in (torch.float64, torch.float32):
                tag = "fp64" if dtype == torch.float64 else "fp32"
                model, targets = models[dtype]
                result, _, _, _, _, mask, identical = probe(model, targets, groups, case, dtype)
                ref = reference[f"{name}/{tag}"]
                logits = gather_vocab(result.logits, groups.tp)
                tangent = gather_vocab(result.tangent, groups.tp)
                entry["sequence_parallel"] = bool(model.config.sequence_parallel) and all(
                    target.module.sequence_parallel for target in targets
                )
                entry[f"primal_identical_{tag}"] = identical
                entry[f"logits_rel_err_{tag}"] = rel_err(logits, ref["logits"])
                entry[f"tangent_rel_err_{tag}"] = rel_err(tangent, ref["tangent"])
                parallel_kl = predicted_kl_vocab_parallel(
                    result.logits, result.tangent, temperature=TEMPERATURE, tp_group=groups.tp,
                    mask=mask, vocab_size=VOCAB, chunk_positions=5,
                )
                full_kl = predicted_kl(
                    logits, tangent, temperature=TEMPERATURE, mask=mask, vocab_size=VOCAB
                )
                entry[f"predicted_kl_{tag}"] = parallel_kl.mean()
                entry[f"predicted_kl_vs_tp1_rel_err_{tag}"] = scalar_rel_err(
                    parallel_kl.mean(), ref["predicted_kl"]
                )
                entry[f"predicted_kl_parallel_vs_full_rel_err_{tag}"] = scalar_rel_err(
                    float(parallel_kl.total), float(full_kl.total)
                )
                entry[f"counts_equal_{tag}"] = float(parallel_kl.count) == float(full_kl.count)
                # Every TP rank holds the full result, so a sum over the TP group doubles both.
                summed = parallel_kl.all_reduced(groups.tp)
                entry[f"all_reduced_doubles_sum_and_count_{tag}"] = (
                    float(summed.total) == 2 * float(parallel_kl.total)
                    and float(summed.count) == 2 * float(parallel_kl.count)
                )
                new_shard = result.logits + EXACT_KL_STEP * result.tangent
                parallel_exact = exact_kl_vocab_parallel(
                    result.logits, new_shard, temperature=TEMPERATURE, tp_group=groups.tp,
                    mask=mask, vocab_size=VOCAB, chunk_positions=5,
                )
                full_exact = exact_kl(
                    logits, gather_vocab(new_shard, groups.tp), temperature=TEMPERATURE,
                    mask=mask, vocab_size=VOCAB,
                )
                entry[f"exact_kl_parallel_vs_full_rel_err_{tag}"] = scalar_rel_err(
                    float(parallel_exact.total), float(full_exact.total)
                )
            layout_report[name] = entry
        report["layouts"][layout] = layout_report
    start = time.perf_counter()
    report["kl_stream"] = layout_steps()
    report["kl_stream_seconds"] = time.perf_counter() - start
    return report


def tp1_cfg(args, world: int):
    return build_cfg(1, False, 1, CASES["targets"]["overrides"])


def tp2_cfg(args, world: int):
    return build_cfg(2, False, 2, CASES["targets"]["overrides"])


if __name__ == "__main__":
    run_worker({
        "tp1": Case(tp1_cfg, run_reference, output="tp1.json", world_sizes=(1,)),
        "tp2": Case(tp2_cfg, run_layouts, output="tp2.json", world_sizes=(2,)),
    })
