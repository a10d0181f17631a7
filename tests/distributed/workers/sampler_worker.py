"""Measure the Megatron rollout engine on real Megatron-Core GPT models over gloo.

Run under torchrun with 1 process (``--case tp1``, the reference; writes ``tp1.json``) or 2
processes (``--case layouts``, one after another in the same job: TP=2, TP=2 with sequence
parallelism, DP=2 and PP=2; writes ``layouts.json``) into ``--out``. The pytest side asserts the
claims.

Every layout builds the same tiny fp32 GPT (layout-independent initialisation from one seed;
rotary positions, grouped-query attention) and generates responses to the same six prompts of
different lengths (2..9 tokens, so the prompt block needs padding and, under SP, rounding up to
the TP size) under three sampling configurations (greedy; temperature 1; temperature 0.7 with
top-p 0.5), each with the same seed. Per layout and configuration it records the merged global
responses, their log-probs, whether all ranks of a data-parallel replica hold identical batches,
and the largest gap between the sampler's log-probs and the trainer's recomputation
(``compute_token_logprobs``) under that layout.

The 1-process run also measures, against independent references:

* the trainer's recomputation against ``log_softmax`` of a plain forward's full-vocabulary logits;
* ``sampling_logprobs - logprobs`` against ``-log(nucleus mass)`` computed from that plain forward
  by a per-token loop, and whether every sampled token lies in that nucleus;
* KV-cached greedy decoding against cache-free greedy decoding (one unpadded sequence at a time,
  the full prefix recomputed each step), with rotary and with learned absolute positions;
* EOS and ``max_new_tokens`` (with the number of model forwards counted by a hook);
* generation in chunks (``max_batch_size``) against one batch;
* weights and training flags before and after generation; the engine's errors.

The 2-process run also checks Megatron's vocab-parallel log-probs and their gradients against a
full-vocabulary autograd reference, and that ranks given different requests refuse to generate.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from harness import Case, raised_errors, run_worker, switch_layout

from megatron_logra.config import load_config
from megatron_logra.mcore.inference.sampler import MegatronSampler
from megatron_logra.mcore.inference.token_logprobs import (
    compute_token_logprobs,
    token_logprobs_from_logits,
)
from megatron_logra.mcore.models.gpt import build_model_chunks
from megatron_logra.mcore.models.sharding import global_named_parameters
from megatron_logra.rl.rollout import RolloutBatch, SamplingParams
from tests.layouts import LAYOUTS, SAMPLER_LAYOUTS
from tests.presets import NARROW, tiny_gpt

VOCAB = 100  # padded to 128 by the model: padding ids exist and must never be sampled
SEED = 20260
MAX_NEW = 8
PROMPT_LENGTHS = (5, 2, 9, 4, 7, 3)
CONFIGS: dict[str, SamplingParams] = {
    "greedy": SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0),
    "sampled": SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0),
    "nucleus": SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, top_p=0.5),
}


def build_cfg(world: int, overrides: list[str]):
    base = [
        "parallel.device=cpu", *tiny_gpt(**NARROW), "model.num_query_groups=2",
        "model.init_method_std=0.2", "train.micro_batch_size=1", "train.global_batch_size=2",
        "train.seed=5",
    ]
    return load_config(None, base + overrides).resolved(world)


def layout_cfg(layout: str):
    nproc, overrides = LAYOUTS[layout]
    return build_cfg(nproc, overrides)


def make_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(99)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def batch_record(batch: RolloutBatch) -> dict[str, Any]:
    return {
        "indices": list(batch.sequence_indices),
        "responses": batch.responses(),
        "lengths": batch.response_lengths.tolist(),
        "finished": batch.finished.tolist(),
        "logprobs": [
            batch.logprobs[i, : int(n)].tolist() for i, n in enumerate(batch.response_lengths)
        ],
        "sampling_logprobs": [
            batch.sampling_logprobs[i, : int(n)].tolist()
            for i, n in enumerate(batch.response_lengths)
        ],
    }


def recompute_gap(chunks, batch: RolloutBatch, groups) -> float:
    """Largest |sampler log-prob - trainer log-prob| over this rank's response tokens."""
    padded = batch.to_padded(0, pad_to_multiple_of=groups.tp_size)
    trainer = compute_token_logprobs(
        chunks, padded.tokens, padded.labels, temperature=batch.logprob_temperature,
        vocab_size=VOCAB, groups=groups, micro_batch_size=1,
    ).cpu()
    return float((trainer - padded.rollout_logprobs)[padded.response_mask].abs().max())


class ForwardCounter:
    def __init__(self, module: torch.nn.Module) -> None:
        self.count = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.count += 1


# ----------------------------------------------------------------------------- references


@torch.no_grad()
def cache_free_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding of one unpadded sequence, the full prefix recomputed every step."""
    model.eval()
    sequence = list(prompt)
    for _ in range(steps):
        tokens = torch.tensor([sequence])
        logits = model(tokens, torch.arange(len(sequence))[None], None)
        sequence.append(int(logits[0, -1, :VOCAB].argmax()))
    return sequence[len(prompt):]


@torch.no_grad()
def plain_logits(model, padded) -> torch.Tensor:
    """Full-vocabulary logits of the padded sequences from a plain (cache-free) forward, TP=1."""
    model.eval()
    return model(padded.tokens, padded.position_ids, None)[..., :VOCAB]


def nucleus_reference(logits_V: torch.Tensor, temperature: float, top_p: float) -> tuple[set, float]:
    """The top-p nucleus (ids) and its mass, by walking the sorted probabilities one by one."""
    probs = torch.softmax(logits_V.double() / temperature, dim=-1)
    ranked = sorted(range(len(probs)), key=lambda v: (-float(probs[v]), v))
    members, mass = set(), 0.0
    for v in ranked:
        members.add(v)
        mass += float(probs[v])
        if mass >= top_p:
            break
    return members, mass


# ----------------------------------------------------------------------------- 1 process


def run_reference(args, cfg, groups) -> dict[str, Any]:
    chunks = build_model_chunks(cfg, groups, vocab_size=VOCAB)
    model = chunks[0]
    sampler = MegatronSampler(chunks, groups, vocab_size=VOCAB)
    prompts = make_prompts()
    report: dict[str, Any] = {"configs": {}}

    model.train()
    weights_before = {name: p.detach().clone() for name, p in global_named_parameters(model)}
    batches = {name: sampler.generate(prompts, params, seed=SEED) for name, params in CONFIGS.items()}
    report["weights_unchanged"] = all(
        torch.equal(weights_before[name], p) for name, p in global_named_parameters(model)
    )
    report["training_flags_restored"] = all(m.training for m in model.modules())

    for name, params in CONFIGS.items():
        batch = batches[name]
        entry = batch_record(batch)
        entry["recompute_gap"] = recompute_gap(chunks, batch, groups)
        padded = batch.to_padded(0)
        trainer = compute_token_logprobs(
            chunks, padded.tokens, padded.labels, temperature=batch.logprob_temperature,
            vocab_size=VOCAB, groups=groups, micro_batch_size=3,
        )
        logits = plain_logits(model, padded)
        reference = torch.log_softmax(logits / batch.logprob_temperature, dim=-1).gather(
            2, padded.labels[..., None]
        ).squeeze(2)
        entry["trainer_vs_full_log_softmax"] = float((trainer - reference).abs().max())
        gaps, outside = [], 0
        mask = padded.response_mask
        for i, t in mask.nonzero().tolist():
            members, mass = nucleus_reference(
                logits[i, t], params.logprob_temperature, params.top_p
            )
            outside += int(padded.labels[i, t]) not in members
            measured = float(padded.sampling_logprobs[i, t] - padded.rollout_logprobs[i, t])
            gaps.append(abs(measured - (-math.log(mass))))
        entry["nucleus_log_mass_error"] = max(gaps)
        entry["tokens_outside_nucleus"] = outside
        entry["sampling_equals_logprobs"] = bool(
            torch.equal(batch.sampling_logprobs, batch.logprobs)
        )
        entry["sampling_logprobs_all_zero"] = bool((batch.sampling_logprobs == 0).all())
        entry["num_tokens"] = int(mask.sum())
        report["configs"][name] = entry

    report["cache_free"] = {
        "rope_gqa": {
            "cached": batches["greedy"].responses(),
            "cache_free": [cache_free_greedy(model, p, MAX_NEW) for p in prompts],
        }
    }
    abs_cfg = build_cfg(1, ["model.position_embedding=learned_absolute"])
    abs_chunks = build_model_chunks(abs_cfg, groups, vocab_size=VOCAB)
    abs_batch = MegatronSampler(abs_chunks, groups, vocab_size=VOCAB).generate(
        prompts, CONFIGS["greedy"], seed=SEED
    )
    report["cache_free"]["learned_absolute"] = {
        "cached": abs_batch.responses(),
        "cache_free": [cache_free_greedy(abs_chunks[0], p, MAX_NEW) for p in prompts],
    }

    chunked = MegatronSampler(chunks, groups, vocab_size=VOCAB, max_batch_size=4).generate(
        prompts, CONFIGS["sampled"], seed=SEED
    )
    report["chunked"] = {
        "responses_equal": chunked.responses() == batches["sampled"].responses(),
        "logprob_gap": float((chunked.logprobs - batches["sampled"].logprobs).abs().max()),
    }

    report["eos"] = eos_checks(model, sampler, prompts, batches["sampled"])
    report["errors"] = error_paths(chunks, groups, prompts)
    return report


def eos_checks(model, sampler, prompts, no_eos: RolloutBatch) -> dict[str, Any]:
    """EOS runs compared with the run without EOS (T=1, same seed). The whole batch uses the
    token found in the most responses (several end, at different steps, others run to the
    limit); prompt 0 alone uses the token it sampled at step 2 (the loop must stop after 3)."""
    responses = no_eos.responses()
    counts = {t: sum(t in r for r in responses) for r in responses for t in r}
    eos_batch = min(counts, key=lambda t: (-counts[t], t))
    eos_single = responses[0][2]
    # A second stop token (as a chat template's end of turn beside EOS): the one that comes
    # before the first EOS (or in a response without it) in the most responses.
    def before_eos(response: list[int]) -> list[int]:
        return response[: response.index(eos_batch)] if eos_batch in response else response

    second_stop = min((t for t in counts if t != eos_batch), key=lambda t: (
        -sum(t in before_eos(r) for r in responses), t))
    params = CONFIGS["sampled"]
    counter = ForwardCounter(model)
    forwards = {}
    try:
        runs = {
            "without_eos": (prompts, params),
            "with_eos": (prompts, dataclasses.replace(params, stop_ids=(eos_batch,))),
            "with_stop_set": (prompts, dataclasses.replace(
                params, stop_ids=(eos_batch, second_stop))),
            "single": (prompts[:1], dataclasses.replace(params, stop_ids=(eos_single,))),
        }
        batches = {}
        for name, (run_prompts, run_params) in runs.items():
            counter.count = 0
            batches[name] = sampler.generate(run_prompts, run_params, seed=SEED)
            forwards[name] = counter.count
    finally:
        counter.handle.remove()
    return {
        "eos_batch": eos_batch,
        "eos_single": eos_single,
        "second_stop": second_stop,
        "max_new_tokens": MAX_NEW,
        "reference": batch_record(no_eos),
        **{name: batch_record(batch) for name, batch in batches.items()},
        "forwards": forwards,
    }


def error_paths(chunks, groups, prompts) -> dict[str, str]:
    sampler = MegatronSampler(chunks, groups, vocab_size=VOCAB)
    greedy = CONFIGS["greedy"]
    calls = {
        "token_out_of_vocab": lambda: sampler.generate([[1, VOCAB]], greedy, seed=0),
        "empty_prompt": lambda: sampler.generate([[1], []], greedy, seed=0),
        "negative_seed": lambda: sampler.generate(prompts, greedy, seed=-1),
        "eos_out_of_vocab": lambda: sampler.generate(
            prompts, dataclasses.replace(greedy, stop_ids=(3, VOCAB)), seed=0
        ),
        "two_chunks": lambda: MegatronSampler(chunks * 2, groups, vocab_size=VOCAB),
        "vocab_too_large": lambda: MegatronSampler(chunks, groups, vocab_size=129),
        "positions_exhausted": lambda: MegatronSampler(
            build_model_chunks(
                build_cfg(1, ["model.position_embedding=learned_absolute"]), groups, VOCAB
            ),
            groups, vocab_size=VOCAB,
        ).generate([[1] * 30], SamplingParams(max_new_tokens=3), seed=0),
    }
    return raised_errors(calls)


# ----------------------------------------------------------------------------- 2 processes


def vocab_parallel_gradient_check(groups) -> dict[str, float]:
    """token_logprobs_from_logits on TP=2 vocabulary shards vs autograd through a full-vocabulary
    log_softmax: values and gradients (gathered over the shards)."""
    generator = torch.Generator().manual_seed(4)
    full = 3.0 * torch.randn(2, 5, 128, generator=generator)
    labels = torch.randint(0, VOCAB, (2, 5), generator=generator)
    weights = torch.randn(2, 5, generator=generator)
    temperature = 0.7
    width = 128 // groups.tp_size
    shard = full[..., groups.tp_rank * width : (groups.tp_rank + 1) * width].clone()
    shard.requires_grad_(True)
    values = token_logprobs_from_logits(
        shard, labels, temperature=temperature, vocab_size=VOCAB, tp_rank=groups.tp_rank
    )
    (values * weights).sum().backward()
    pieces = [torch.empty_like(shard) for _ in range(groups.tp_size)]
    dist.all_gather(pieces, shard.grad.contiguous(), group=groups.tp)
    grad = torch.cat(pieces, dim=-1)
    reference_logits = full.clone().requires_grad_(True)
    reference = torch.log_softmax(reference_logits[..., :VOCAB] / temperature, dim=-1).gather(
        2, labels[..., None]
    ).squeeze(2)
    (reference * weights).sum().backward()
    return {
        "value_error": float((values.detach() - reference.detach()).abs().max()),
        "grad_error": float((grad - reference_logits.grad).abs().max()),
        "padding_grad_max": float(grad[..., VOCAB:].abs().max()),
    }


def run_layouts(args, cfg, groups) -> dict[str, Any]:
    """Every layout of SAMPLER_LAYOUTS in turn; the harness set up the first."""
    prompts = make_prompts()
    report: dict[str, Any] = {"layouts": {}}
    for layout in SAMPLER_LAYOUTS:
        if layout != SAMPLER_LAYOUTS[0]:
            cfg = layout_cfg(layout)
            groups = switch_layout(cfg)
        chunks = build_model_chunks(cfg, groups, vocab_size=VOCAB)
        sampler = MegatronSampler(chunks, groups, vocab_size=VOCAB)
        entry: dict[str, Any] = {
            "tp": groups.tp_size, "pp": groups.pp_size, "dp": groups.dp_size,
            "sequence_parallel": bool(cfg.parallel.sp), "configs": {},
        }
        for name, params in CONFIGS.items():
            batch = sampler.generate(prompts, params, seed=SEED)
            gap = recompute_gap(chunks, batch, groups)
            everyone: list[Any] = [None] * groups.world_size
            dist.all_gather_object(
                everyone, (groups.dp_rank, batch_record(batch), gap, len(batch.sequence_indices))
            )
            by_dp: dict[int, list[dict[str, Any]]] = {}
            for dp_rank, record, _, _ in everyone:
                by_dp.setdefault(dp_rank, []).append(record)
            replicas_identical = all(
                all(record == records[0] for record in records) for records in by_dp.values()
            )
            shares = [by_dp[d][0] for d in sorted(by_dp)]
            merged = {key: [v for share in shares for v in share[key]] for key in shares[0]}
            entry["configs"][name] = {
                **merged,
                "replicas_identical": replicas_identical,
                "share_sizes": sorted({size for _, _, _, size in everyone}),
                "recompute_gap": max(g for _, _, g, _ in everyone),
            }
        if layout == "tp2":
            entry["vocab_parallel_gradients"] = vocab_parallel_gradient_check(groups)
        if layout == "dp2":
            try:
                sampler.generate(prompts, CONFIGS["greedy"], seed=SEED + groups.world_rank)
                entry["mismatched_request"] = "no exception"
            except RuntimeError as error:
                entry["mismatched_request"] = f"RuntimeError: {error}"
        report["layouts"][layout] = entry
    return report


if __name__ == "__main__":
    run_worker({
        "tp1": Case(lambda args, world: build_cfg(1, []), run_reference, output="tp1.json",
                    world_sizes=(1,)),
        "layouts": Case(lambda args, world: layout_cfg(SAMPLER_LAYOUTS[0]), run_layouts,
                        output="layouts.json", world_sizes=(2,)),
    })
