"""Packed sequences against the padded path on real Megatron-Core GPTs (run with torchrun).

Case ``single`` (1 process, TP=1), for ``sdpa`` and ``local`` attention:

* ``sketch``: a float64 LoGRA-sketched model; the sketch of one packed row of five sequences
  against the sum of the sketches of the same sequences padded to ``model.seq_length`` in three
  microbatches (max |difference| / max |padded|);
* ``neighbours``: one sequence packed with two different pairs of neighbours, at different
  offsets of the row: the max |difference| of its per-token losses (fp32);
* ``jvp``: float64 forward-mode AD with a tangent on the word embeddings and on every layer's
  input norm (so it enters every attention): the logits' tangent of a packed row against each
  sequence's own unpacked forward (and the primal logits likewise).

Case ``rl`` (2 or 4 processes, layouts from ``--layouts``): at each layout, RL jobs (the tiny
GPT, paper-mode LoGRA under the KL step control) with ``train.packing`` on and off run the same
steps from the same start; the report holds both jobs' step records and the largest entry
difference of their full weights after the steps. Before training, both batchings of one step's
rollouts compute the policy's (and with GRPO the reference model's) per-token log-probs on the
same model: their largest relative difference over every response token of the step. With
``--grpo`` also the GRPO preset with a reference KL and two updates per rollout batch (fixed
advantages: a random model's rewards all tie, which would leave GRPO nothing to learn); with
``--bf16`` also the paper preset in bf16 (masters sharded over DP). Full weights are compared
after the first and the last step. With ``--library`` also LoGRA's library mode (under the KL
step control too). With ``--sft``, ``sft`` on prompt data (the supervised trainer, LoGRA under
the KL step control) packed and padded at those layouts: step records and weights.

Context parallelism (a layout with ``cp`` in its name), ``cp_fp64``: the single case's row of
five sequences (each padded to a multiple of ``2 cp``) split over the CP ranks on a float64
model built with CP: its logits and their forward-mode tangent gathered back into row order,
and its LoGRA sketch summed over the CP ranks, against each sequence alone on the same model
with CP switched off (``context_parallel_off``: whole sequences on one rank); ``--cp-fp64``
names more layouts that run this check alone. Then each such
layout's packed run is also
compared with the packed and the padded run of a layout without CP (``--cp1``), on the same
rollouts (the built-in sampler's, which any layout generates alike): the step records' largest
relative differences and the full weights after the last step (``cp_vs_cp1``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.autograd.forward_ad as fwAD
from harness import Case, run_worker, switch_layout

from megatron_logra.config import load_config
from megatron_logra.context_parallel import gather_packed_row
from megatron_logra.mcore import gather_full_weights, packed_seq_params
from megatron_logra.mcore.compat.forward_ad import install_forward_ad_rules
from megatron_logra.mcore.models.context_parallel import context_parallel_off
from megatron_logra.mcore.models.gpt import build_model
from megatron_logra.mcore.models.targets import find_targets
from megatron_logra.mcore.tensor_parallel.sketched_linear import LayerSketch
from megatron_logra.packing import RowLayout, pack_row, unpack_row
from megatron_logra.projection import generate_projection, projection_key
from megatron_logra.sketch_buffer import FlatSketchBuffer, SketchSlot
from megatron_logra.train.rl.collectives import gather_dp
from megatron_logra.train.rl.job import RLJob
from megatron_logra.train.rl.rollouts import collect_rollouts
from megatron_logra.train.rl.update_batches import update_batches
from megatron_logra.train.supervised import SupervisedJob
from tests.layouts import LAYOUTS
from tests.presets import NARROW, SWIGLU_RMSNORM_NO_BIAS, tiny_gpt
from tests.torchrun import REPO

VOCAB = 100
SEQ = 16
SKETCH_RANK = 8
LENGTHS = (5, 9, 3, 12, 7)
ATTENTIONS = ("sdpa", "local")
RL_CONFIG = REPO / "configs" / "demo_rl_cpu.yaml"
RL_STEPS = 3
# About three of the tiny RL job's sequences (prompt ~9 + response <= 5 tokens) per row, so a
# rank runs several packed microbatches.
RL_BUDGET = 40


# ----------------------------------------------------------------------------- single process

def single_cfg(args, world: int):
    del args, world
    return load_config(None, ["parallel.device=cpu", "parallel.tp=1",
                              *tiny_gpt(**NARROW, seq_length=SEQ), *SWIGLU_RMSNORM_NO_BIAS,
                              "model.position_embedding=rope"]).resolved(1)


def _with_attention(cfg, attention: str):
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=attention))


def _sequences() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n + 1,), generator=generator) for n in LENGTHS]


def _layout(lengths: Sequence[int], spans: Sequence[int] | None = None, multiple: int = 1
            ) -> RowLayout:
    """A row of ``lengths`` (each in its span), its tail padded to ``multiple``."""
    spans = list(spans or lengths)
    spans[-1] += -sum(spans) % multiple
    return RowLayout(lengths=tuple(lengths), spans=tuple(spans), row_length=sum(spans))


def _row_multiple(cfg) -> int:
    return cfg.parallel.tp if cfg.parallel.sp else 1


def _packed_inputs(seqs: Sequence[torch.Tensor], layout: RowLayout):
    tokens = pack_row([s[:-1] for s in seqs], layout, 0)
    labels = pack_row([s[1:] for s in seqs], layout, 0)
    return tokens, labels, layout.position_ids()


def _padded_inputs(seqs: Sequence[torch.Tensor]):
    tokens = torch.zeros(len(seqs), SEQ, dtype=torch.int64)
    labels = torch.zeros(len(seqs), SEQ, dtype=torch.int64)
    mask = torch.zeros(len(seqs), SEQ, dtype=torch.float64)
    for row, s in enumerate(seqs):
        tokens[row, :len(s) - 1], labels[row, :len(s) - 1] = s[:-1], s[1:]
        mask[row, :len(s) - 1] = 1.0
    return tokens, labels, torch.arange(SEQ).expand(len(seqs), SEQ), mask


def _sketch_buffer(model, groups) -> FlatSketchBuffer:
    targets = find_targets([model], ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                           tp_rank=groups.tp_rank)
    buffer = FlatSketchBuffer(
        [SketchSlot(t.layer_key, t.rows, SKETCH_RANK, t.tp_partial) for t in targets],
        device="cpu", dtype=torch.float64,
    )
    for t in targets:
        t.weight.requires_grad_(False)
        full = generate_projection(projection_key(42, 0, t.layer_key), SKETCH_RANK, 0,
                                   t.in_features, "rademacher")
        t.module.logra_sketch = LayerSketch(t.layer_key, full[:, t.col_start:t.col_end], buffer)
    return buffer


def measure_sketch(cfg, groups) -> float:
    """max |S_packed - sum S_padded| / max |sum S_padded|, float64."""
    seqs = _sequences()
    model = build_model(cfg, groups, VOCAB).double()
    buffer = _sketch_buffer(model, groups)
    layout = _layout([len(s) - 1 for s in seqs], multiple=_row_multiple(cfg))
    tokens, labels, positions = _packed_inputs(seqs, layout)
    losses = model(tokens, positions, None, labels=labels,
                   packed_seq_params=packed_seq_params(layout, "cpu"))
    losses.sum().backward()
    packed = buffer.data.clone()
    buffer.data.zero_()
    for chunk in (seqs[:2], seqs[2:4], seqs[4:]):  # three padded microbatches
        tokens, labels, positions, mask = _padded_inputs(chunk)
        (model(tokens, positions, None, labels=labels) * mask).sum().backward()
    return float((packed - buffer.data).abs().max() / buffer.data.abs().max())


def measure_neighbours(cfg, groups) -> float:
    """The same sequence first in one row and last in another, beside other sequences."""
    seqs = _sequences()
    model = build_model(cfg, groups, VOCAB)
    model.eval()
    losses = []
    for order in ((0, 1, 2), (3, 4, 0)):
        chosen = [seqs[i] for i in order]
        # Spans longer than the sequences: padding between them too.
        layout = _layout([len(s) - 1 for s in chosen], [len(s) + 1 for s in chosen],
                         _row_multiple(cfg))
        tokens, labels, positions = _packed_inputs(chosen, layout)
        with torch.no_grad():
            out = model(tokens, positions, None, labels=labels,
                        packed_seq_params=packed_seq_params(layout, "cpu"))
        per_sequence = unpack_row(out, layout)
        losses.append(per_sequence[order.index(0), :len(seqs[0]) - 1])
    return float((losses[0] - losses[1]).abs().max() / losses[1].abs().max())


def _dual_forward(model, tangents: dict, tokens, positions, packed=None):
    """Logits and their tangent along ``tangents`` ({parameter name: tangent})."""
    install_forward_ad_rules()
    params = dict(model.named_parameters())
    with torch.no_grad(), fwAD.dual_level():
        for name, tangent in tangents.items():
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            module._parameters[attr] = fwAD.make_dual(params[name].detach(), tangent)
        try:
            out = model(tokens, positions, None, packed_seq_params=packed)
            primal, tangent = fwAD.unpack_dual(out)
        finally:
            for name in tangents:
                module_name, _, attr = name.rpartition(".")
                model.get_submodule(module_name)._parameters[attr] = params[name]
    return primal, tangent


def _float64_model_with_tangents(cfg, groups):
    """The float64 model in eval mode and seeded tangents of the embedding and input norms."""
    model = build_model(cfg, groups, VOCAB).double()
    model.eval()
    generator = torch.Generator().manual_seed(5)
    tangents = {name: torch.randn(p.shape, generator=generator, dtype=torch.float64)
                for name, p in model.named_parameters()
                if name == "embedding.word_embeddings.weight" or "input_layernorm" in name}
    return model, tangents


def measure_jvp(cfg, groups) -> dict[str, float]:
    seqs = _sequences()
    model, tangents = _float64_model_with_tangents(cfg, groups)
    multiple = _row_multiple(cfg)
    layout = _layout([len(s) - 1 for s in seqs], [len(s) + 1 for s in seqs], multiple)
    tokens, _, positions = _packed_inputs(seqs, layout)
    primal, tangent = _dual_forward(model, tangents, tokens, positions,
                                    packed_seq_params(layout, "cpu"))
    primal, tangent = unpack_row(primal, layout), unpack_row(tangent, layout)
    primal_err = tangent_err = 0.0
    for i, s in enumerate(seqs):
        n = len(s) - 1
        # Alone and unpacked, padded at its end to the row multiple (causal: no effect on it).
        alone = torch.nn.functional.pad(s[None, :-1], (0, -n % multiple))
        want_p, want_t = _dual_forward(model, tangents, alone,
                                       torch.arange(alone.shape[1])[None])
        want_p, want_t = want_p[:, :n], want_t[:, :n]
        primal_err = max(primal_err, float((primal[i, :n] - want_p[0]).abs().max()
                                           / want_p.abs().max()))
        tangent_err = max(tangent_err, float((tangent[i, :n] - want_t[0]).abs().max()
                                             / want_t.abs().max()))
    return {"primal_rel_err": primal_err, "tangent_rel_err": tangent_err}


def measure_cp_fp64(layout_name: str, world: int) -> dict[str, float]:
    """A packed row split over CP against each of its sequences alone without CP (float64), at
    ``layout_name`` (its TP, SP and CP; the DP replicas repeat it)."""
    _, parallel = LAYOUTS[layout_name]
    cfg = load_config(None, ["parallel.device=cpu", *parallel,
                             *tiny_gpt(**NARROW, seq_length=SEQ), *SWIGLU_RMSNORM_NO_BIAS,
                             "model.position_embedding=rope"]).resolved(world)
    groups = switch_layout(cfg)
    cp, multiple = groups.cp_size, _row_multiple(cfg)
    seqs = _sequences()
    step = 2 * cp * multiple
    layout = _layout([len(s) - 1 for s in seqs], [-(-(len(s) - 1) // step) * step for s in seqs])
    mine = layout.on_cp_rank(groups.cp_rank, cp)
    tokens, labels, positions = _packed_inputs(seqs, layout)
    mask = pack_row([torch.ones(len(s) - 1, dtype=torch.float64) for s in seqs], layout, 0.0)
    packed = packed_seq_params(layout, "cpu")
    model, tangents = _float64_model_with_tangents(cfg, groups)
    primal, tangent = _dual_forward(model, tangents, mine.split_row(tokens),
                                    mine.split_row(positions), packed)
    primal, tangent = (unpack_row(gather_packed_row(t, mine, groups.cp), layout)
                       for t in (primal, tangent))

    def alone(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Unpacked, padded at its end to the SP multiple (causal: no effect on its tokens).
        n = len(s) - 1
        pad = -n % multiple
        return (torch.nn.functional.pad(s[None, :-1], (0, pad)),
                torch.nn.functional.pad(s[None, 1:], (0, pad)),
                torch.arange(n + pad)[None])

    errors = {"primal_rel_err": 0.0, "tangent_rel_err": 0.0}
    with context_parallel_off(model):
        for i, s in enumerate(seqs):
            n = len(s) - 1
            inputs, _, where = alone(s)
            want_p, want_t = _dual_forward(model, tangents, inputs, where)
            for key, got, want in (("primal_rel_err", primal, want_p),
                                   ("tangent_rel_err", tangent, want_t)):
                errors[key] = max(errors[key], float((got[i, :n] - want[0, :n]).abs().max()
                                                     / want[0, :n].abs().max()))
    model.train()
    buffer = _sketch_buffer(model, groups)
    losses = model(mine.split_row(tokens), mine.split_row(positions), None,
                   labels=mine.split_row(labels), packed_seq_params=packed)
    (losses * mine.split_row(mask)).sum().backward()
    packed_sketch = buffer.data.clone()
    torch.distributed.all_reduce(packed_sketch, group=groups.cp)
    buffer.data.zero_()
    with context_parallel_off(model):
        for s in seqs:
            inputs, targets, where = alone(s)
            counted = (torch.arange(inputs.shape[1]) < len(s) - 1).double()[None]
            (model(inputs, where, None, labels=targets) * counted).sum().backward()
    errors["sketch_rel_err"] = float((packed_sketch - buffer.data).abs().max()
                                     / buffer.data.abs().max())
    return errors


def measure_single(args, cfg, groups):
    del args
    report = {}
    for attention in ATTENTIONS:
        at = _with_attention(cfg, attention)
        report[attention] = {"sketch_rel_err": measure_sketch(at, groups),
                             "neighbours_rel_err": measure_neighbours(at, groups),
                             **measure_jvp(at, groups)}
    return report


# ----------------------------------------------------------------------------- RL jobs

def rl_overrides(args, layout: str, *, packed: bool, grpo: bool, library: bool = False
                 ) -> list[str]:
    _, parallel = LAYOUTS[layout]
    preset = "grpo" if grpo else "library" if library else "paper"
    tag = f"{layout}_{preset}_{'packed' if packed else 'padded'}"
    out = [
        *parallel, *tiny_gpt(), "train.micro_batch_size=4", "rl.prompts_per_step=8",
        "rl.samples_per_prompt=2", "rl.sampling.max_new_tokens=5",
        "logra.kl_control.probe_responses=4",
        # A budget that keeps alpha below its cap (so alpha is compared), and no mismatch
        # subtraction: the built-in sampler computes its log-probs on the unpacked path, so the
        # rollout/trainer gap is 0 bit for bit unpacked and fp32 rounding packed, and alpha
        # would carry that input's difference (the test checks the gap itself).
        "logra.kl_control.kl_budget=1e-5", "logra.kl_control.kl_budget_final=1e-5",
        "logra.kl_control.mismatch_subtraction=false",
        f"train.packing.enabled={str(packed).lower()}", f"data.dir={args.data}",
        f"run.dir={args.out / tag}",
    ]
    if packed:
        out.append(f"train.packing.max_tokens_per_microbatch={RL_BUDGET}")
    if grpo:
        out += ["rl.loss.name=grpo", "rl.loss.grpo.kl_beta=0.05", "rl.updates_per_rollout=2"]
    if library:
        out += ["logra.mode=library", "optimizer.lr=3e-3"]
    return out


def rl_cfg_for(args, world: int, layout: str, *, packed: bool, grpo: bool,
               library: bool = False):
    return load_config(RL_CONFIG, rl_overrides(args, layout, packed=packed, grpo=grpo,
                                               library=library),
                       command="rl").resolved(world, "rl")


def rl_cfg(args, world: int):
    return rl_cfg_for(args, world, args.layouts.split(",")[0], packed=True, grpo=False)


def _fixed_advantages(*, rewards, correct, lengths):
    """Fixed positive advantages: GRPO's loss is then a sum without cancellation, whose
    relative rounding is that of its terms."""
    del correct, lengths
    return torch.tensor([1.0 + (i % 3) / 2 for i in range(len(rewards))])


def compare_logprobs(job, cfg, groups) -> dict[str, float]:
    """Packed and padded log-probs of one step's rollouts on the same model."""
    scored = collect_rollouts(job.engine, job.encoder, job.reward, job.preset.advantages,
                              job.schedule.step_problems(RL_STEPS), rl=cfg.rl, step=RL_STEPS,
                              groups=groups)
    two = dataclasses.replace(cfg.rl, updates_per_rollout=2)
    found = {}
    for packed in (True, False):
        variant = dataclasses.replace(
            cfg, rl=two,
            train=dataclasses.replace(cfg.train, packing=dataclasses.replace(
                cfg.train.packing, enabled=packed)))
        batches = update_batches(variant, scored, pad_id=job.encoder.pad_id, groups=groups,
                                 policy=job.setup.model_chunks, reference=job.reference,
                                 vocab_size=job.vocab_size)
        fields = ["old_logprobs"] + (["reference_logprobs"] if job.reference is not None else [])
        found[packed] = {}
        for field in fields:
            local = {}
            for index, batch in enumerate(batches.microbatches):
                values = getattr(batch, field)
                for row in range(values.shape[0]):
                    local[batches.sequences[index][row]] = values[row][batch.response_mask[row]].cpu()
            merged = {}
            for part in gather_dp([local], groups):
                merged.update(part)
            found[packed][field] = merged
    errors = {}
    for field, want in found[False].items():
        got = found[True][field]
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        errors[f"{field}_rel_err"] = max(
            float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)
        errors[f"{field}_tokens"] = sum(len(v) for v in want.values())
    return errors


def _weight_errors(got: dict, want: dict) -> dict[str, float]:
    """Largest entry difference relative to each tensor's largest entry, and the largest
    per-tensor norm difference."""
    return {
        "max_entry_rel_err": max(float((got[n] - w).abs().max() / w.abs().max().clamp_min(1e-30))
                                 for n, w in want.items()),
        "norm_rel_err": max(float((got[n] - w).norm() / w.norm().clamp_min(1e-30))
                            for n, w in want.items()),
    }


def run_rl(args, world, layout, groups, *, grpo: bool, bf16: bool = False,
           library: bool = False) -> dict:
    out = {}
    weights: dict[bool, list[dict]] = {}
    for packed in (True, False):
        cfg = rl_cfg_for(args, world, layout, packed=packed, grpo=grpo, library=library)
        if bf16:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                     params_dtype="bf16"),
                                      logra=dataclasses.replace(cfg.logra,
                                                                master_weights="dp_sharded"))
        job = RLJob(cfg, groups)
        try:
            if grpo:
                job.preset.advantages.compute = _fixed_advantages
            records, weights[packed] = [], []
            for step in range(RL_STEPS):
                records.append(job.step(step))
                if step in (0, RL_STEPS - 1):
                    weights[packed].append(gather_full_weights(job.setup.model_chunks, groups))
            if packed and not bf16:
                out["logprobs"] = compare_logprobs(job, cfg, groups)
        finally:
            job.close()
        out["packed" if packed else "padded"] = [
            {key: value for key, value in record.items() if isinstance(value, (int, float))}
            for record in records]
    out["weights_first_step"] = _weight_errors(weights[True][0], weights[False][0])
    out["weights_last_step"] = _weight_errors(weights[True][-1], weights[False][-1])
    out["padded_weights"] = weights[False][-1]
    out["packed_weights"] = weights[True][-1]
    return out


STEP_KEYS = ("loss", "alpha", "kl_predicted", "kl_realized")


def _cp_vs_cp1(run: dict, reference: dict) -> dict:
    """A CP layout's packed run against a CP=1 layout's packed and padded runs."""
    out = {}
    for batching in ("packed", "padded"):
        steps = {key: max(abs(got[key] - want[key]) / abs(want[key]) for got, want in zip(
            run["packed"], reference[batching], strict=True)) for key in STEP_KEYS}
        out[f"vs_{batching}"] = {
            **{f"{key}_rel_err": value for key, value in steps.items()},
            **_weight_errors(run["packed_weights"], reference[f"{batching}_weights"])}
    return out


def sft_cfg_for(args, world: int, layout: str, *, packed: bool):
    _, parallel = LAYOUTS[layout]
    overrides = [
        *parallel, *tiny_gpt(num_layers=4), "train.micro_batch_size=4",
        "train.global_batch_size=16", "logra.kl_control.kl_budget=1e-5",
        "logra.kl_control.kl_budget_final=1e-5", f"data.dir={args.data}",
        f"train.packing.enabled={str(packed).lower()}",
        f"run.dir={args.out / f'sft_{layout}_{packed}'}",
    ]
    if packed:
        overrides.append(f"train.packing.max_tokens_per_microbatch={RL_BUDGET}")
    return load_config(RL_CONFIG, overrides, command="sft").resolved(world, "sft")


def run_sft(args, world, layout, groups) -> dict:
    """Supervised steps on prompt data (LoGRA paper mode under the KL step control, as the
    demo config has it), packed and padded."""
    out, weights = {}, {}
    for packed in (True, False):
        job = SupervisedJob(sft_cfg_for(args, world, layout, packed=packed), groups)
        records = [job.step(step) for step in range(RL_STEPS)]
        weights[packed] = gather_full_weights(job.setup.model_chunks, groups)
        out["packed" if packed else "padded"] = [
            {key: value for key, value in record.items() if isinstance(value, (int, float))}
            for record in records]
    out["weights_last_step"] = _weight_errors(weights[True], weights[False])
    return out


def measure_rl(args, cfg, groups):
    del cfg
    world = groups.world_size
    report = {}
    padded = {}
    kept: dict[tuple[str, str], dict] = {}  # (layout, preset): the run with its weights
    for layout in filter(None, args.layouts.split(",")):
        if "cp" in layout:
            report.setdefault("cp_fp64", {})[layout] = measure_cp_fp64(layout, world)
        groups = switch_layout(rl_cfg_for(args, world, layout, packed=True, grpo=False))
        report[layout] = {"paper": run_rl(args, world, layout, groups, grpo=False)}
        if layout in args.grpo.split(","):
            report[layout]["grpo"] = run_rl(args, world, layout, groups, grpo=True)
        if layout in args.bf16.split(","):
            report[layout]["bf16"] = run_rl(args, world, layout, groups, grpo=False, bf16=True)
        if layout in args.library.split(","):
            report[layout]["library"] = run_rl(args, world, layout, groups, grpo=False,
                                               library=True)
        padded[layout] = report[layout]["paper"]["padded_weights"]
        for preset, run in report[layout].items():
            kept[layout, preset] = dict(run)
            run.pop("padded_weights")
            run.pop("packed_weights")
    for layout in filter(None, args.cp_fp64.split(",")):
        report.setdefault("cp_fp64", {})[layout] = measure_cp_fp64(layout, world)
    cp1 = args.cp1 or next((layout for layout in padded if "cp" not in layout), None)
    cp_vs_cp1 = {}
    for layout in padded:
        if "cp" in layout and cp1 is not None:
            for preset in report[layout]:
                if (cp1, preset) in kept:
                    cp_vs_cp1[f"{layout}_vs_{cp1}:{preset}"] = _cp_vs_cp1(
                        kept[layout, preset], kept[cp1, preset])
    for layout in filter(None, args.sft.split(",")):
        groups = switch_layout(sft_cfg_for(args, world, layout, packed=True))
        report.setdefault(layout, {})["sft"] = run_sft(args, world, layout, groups)
    # For scale: how far a change of layout alone moves the unpacked run's weights.
    layouts = list(padded)
    report["padded_layout_changes"] = {
        f"{a}_vs_{b}": _weight_errors(padded[a], padded[b])
        for a, b in zip(layouts, layouts[1:], strict=False)}
    report["cp_vs_cp1"] = cp_vs_cp1
    return report


def add_arguments(parser) -> None:
    parser.add_argument("--data")
    parser.add_argument("--layouts", default="tp1")
    parser.add_argument("--grpo", default="", help="layouts that also run the GRPO preset")
    parser.add_argument("--bf16", default="", help="layouts that also run in bf16")
    parser.add_argument("--cp-fp64", default="",
                        help="CP layouts that run only the float64 packed-row check")
    parser.add_argument("--cp1", default="",
                        help="the CP=1 layout the CP layouts are compared with (default: the "
                        "first without CP)")
    parser.add_argument("--library", default="",
                        help="layouts that also run LoGRA's library mode")
    parser.add_argument("--sft", default="", help="layouts that run sft packed and padded")


if __name__ == "__main__":
    run_worker({"single": Case(single_cfg, measure_single, world_sizes=(1,)),
                "rl": Case(rl_cfg, measure_rl)}, add_arguments)
