"""The RL policy update on packed rows against the padded path, at a realistic length mix.

    python tools/bench_packing.py                          # defaults below, CPU, one process
    python tools/bench_packing.py --sequences 32 --hidden 512 --layers 4 --json
    python tools/bench_packing.py --no-kl-control --rounds 3

One step's rollouts are drawn at an RL length mix -- prompts uniform in 50-300 tokens,
responses log-normal with median ``--response-median`` (600) capped at ``--response-cap``
(4096), random token ids -- and the same RL policy update (LoGRA in paper mode, the predicted-KL
step control on: the paper's method) runs on them as the trainer batches them with
``train.packing`` on (rows of ``--budget`` tokens, balanced) and off (every sequence padded to
``model.seq_length``, ``--micro-batch-size`` per microbatch). Both variants share one model and
optimizer and alternate round by round, so machine load falls on both alike (the weights move a
little each update; the shapes and the work do not depend on them).

Printed per variant: microbatches, tokens processed (padding included), padding fraction, and
the median over ``--rounds`` of: the update (Megatron's forward/backward schedule over the
microbatches + the optimizer step, which runs the KL probe), the schedule alone (the update
less the optimizer step), and the process's CPU time for the update. Then the goal of the packing issue: padding <= 5% of the
processed tokens, and the packed update within 1.3x of ``(real tokens / padded tokens) x`` the
padded update (the schedule's time; the optimizer step and the probe are the same work in both).
The machine's load average is printed beside the times.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PADDING_GOAL = 0.05
"""The issue's goal: padding <= 5% of the processed tokens."""
TIME_GOAL = 1.3
"""The issue's goal: packed time <= 1.3 x (real / padded tokens) x padded time."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--sequences", type=int, default=16, help="responses in the step")
    parser.add_argument("--prompt-min", type=int, default=50)
    parser.add_argument("--prompt-max", type=int, default=300)
    parser.add_argument("--response-median", type=int, default=600)
    parser.add_argument("--response-sigma", type=float, default=0.6,
                        help="log-normal sigma of the response lengths")
    parser.add_argument("--response-cap", type=int, default=4096)
    parser.add_argument("--seq-length", type=int, default=4608,
                        help="model.seq_length (the padded length): >= prompt max + cap")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--budget", type=int, default=None,
                        help="train.packing.max_tokens_per_microbatch (default: micro batch "
                        "size x seq length)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--query-groups", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--sketch-rank", type=int, default=64)
    parser.add_argument("--attention", default="sdpa", choices=("sdpa", "local"))
    parser.add_argument("--no-kl-control", action="store_true",
                        help="LoGRA paper mode without the predicted-KL step control")
    parser.add_argument("--rounds", type=int, default=2, help="timed updates per variant")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", action="store_true")
    return parser


def length_mix(args: argparse.Namespace) -> list[tuple[int, int]]:
    """``(prompt, response)`` token counts of the step."""
    rng = random.Random(args.seed)
    mu = math.log(args.response_median)
    return [(rng.randint(args.prompt_min, args.prompt_max),
             max(1, min(args.response_cap, int(rng.lognormvariate(mu, args.response_sigma)))))
            for _ in range(args.sequences)]


def overrides(args: argparse.Namespace) -> list[str]:
    out = [
        "parallel.device=cpu", "parallel.tp=1", f"model.num_layers={args.layers}",
        f"model.hidden_size={args.hidden}", f"model.num_attention_heads={args.heads}",
        f"model.num_query_groups={args.query_groups}", f"model.ffn_hidden_size={args.ffn}",
        f"model.seq_length={args.seq_length}", f"model.vocab_size={args.vocab}",
        "model.activation=swiglu", "model.normalization=RMSNorm", "model.add_bias_linear=false",
        "model.position_embedding=rope", f"model.attention={args.attention}",
        f"train.micro_batch_size={args.micro_batch_size}",
        f"rl.prompts_per_step={args.sequences}", "rl.samples_per_prompt=1",
        f"rl.sampling.max_new_tokens={args.response_cap}", "optimizer.name=logra",
        "logra.mode=paper", f"logra.sketch_rank={args.sketch_rank}",
        f"logra.kl_control.enabled={str(not args.no_kl_control).lower()}",
        "logra.kl_control.probe_responses=2",
    ]
    if args.budget is not None:
        out.append(f"train.packing.max_tokens_per_microbatch={args.budget}")
    return out


def rollouts(args: argparse.Namespace, mix: list[tuple[int, int]]) -> Any:
    """The step's rollouts (random tokens at the mix's lengths) as the trainer holds them."""
    import torch

    from megatron_logra.rl.rollout import RolloutBatch
    from megatron_logra.train.rl.rollouts import ScoredRollouts

    generator = torch.Generator().manual_seed(args.seed)
    longest = max(response for _, response in mix)
    prompts = tuple(tuple(torch.randint(0, args.vocab, (p,), generator=generator).tolist())
                    for p, _ in mix)
    lengths = torch.tensor([r for _, r in mix], dtype=torch.int64)
    # Positions past a response's length hold 0 (the rollout contract).
    inside = torch.arange(longest)[None, :] < lengths[:, None]
    logprobs = -torch.rand(len(mix), longest, generator=generator) * 5 * inside
    batch = RolloutBatch(
        sequence_indices=tuple(range(len(mix))), prompt_tokens=prompts,
        response_tokens=torch.randint(0, args.vocab, (len(mix), longest),
                                      generator=generator) * inside,
        response_lengths=lengths, logprobs=logprobs, sampling_logprobs=logprobs.clone(),
        finished=torch.ones(len(mix), dtype=torch.bool), logprob_temperature=1.0,
    )
    advantages = torch.randn(len(mix), generator=generator)
    return ScoredRollouts(share=range(len(mix)), rollout=batch, rewards=[0.0] * len(mix),
                          correct=[False] * len(mix), lengths=lengths.tolist(),
                          advantages=advantages)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import dataclasses

    import torch

    from megatron_logra.config import load_config
    from megatron_logra.mcore import build_model_chunks, setup_training
    from megatron_logra.mcore.process_groups import destroy_parallel, init_parallel
    from megatron_logra.probe_batch import rollout_probe_batch
    from megatron_logra.rl.presets import build_preset
    from megatron_logra.train.rl.batching import pad_to_length
    from megatron_logra.train.rl.policy_update import update_policy
    from megatron_logra.train.rl.update_batches import update_batches

    torch.set_num_threads(args.threads)
    mix = length_mix(args)
    if max(p + r for p, r in mix) > args.seq_length:
        raise ValueError(f"--seq-length {args.seq_length} is shorter than the longest sequence "
                         f"{max(p + r for p, r in mix)}; raise it")
    base = load_config(REPO / "configs" / "demo_rl_cpu.yaml", overrides(args), command="rl")
    cfg = base.resolved(1, "rl")
    groups = init_parallel(cfg)
    try:
        chunks = build_model_chunks(cfg, groups, vocab_size=args.vocab)
        setup = setup_training(cfg, chunks, groups, kl_vocab_size=args.vocab)
        preset = build_preset(cfg.rl)
        scored = rollouts(args, mix)
        variants = {}
        for packed in (True, False):
            variant = dataclasses.replace(cfg, train=dataclasses.replace(
                cfg.train, packing=dataclasses.replace(cfg.train.packing, enabled=packed)))
            variants["packed" if packed else "padded"] = update_batches(
                variant, scored, pad_id=0, groups=groups, policy=setup.model_chunks,
                reference=None, vocab_size=args.vocab)
        probe = None
        if setup.kl_control is not None:
            probe = rollout_probe_batch(pad_to_length(scored.rollout, args.seq_length, 0),
                                        scored.share, cfg.logra.kl_control, groups.device,
                                        global_size=len(scored.rewards))
        # The optimizer step (the direction, the KL probe, the merge) is the same work in both
        # variants; the forward/backward schedule is what packing changes.
        step_time: dict[str, float] = {}
        optimizer_step = setup.optimizer.step

        def timed_step() -> Any:
            start = time.perf_counter()
            try:
                return optimizer_step()
            finally:
                step_time["last"] = time.perf_counter() - start

        setup.optimizer.step = timed_step
        times: dict[str, dict[str, list[float]]] = {
            name: {"update_s": [], "schedule_s": [], "update_cpu_s": []} for name in variants}
        for round_index in range(args.rounds + 1):  # the first round warms up
            order = list(variants) if round_index % 2 == 0 else list(variants)[::-1]
            for name in order:
                batches = variants[name]
                wall, cpu = time.perf_counter(), time.process_time()
                update_policy(setup, batches.microbatches, preset.loss, probe=probe,
                              seq_length=batches.seq_length,
                              micro_batch_size=batches.micro_batch_size,
                              vocab_size=args.vocab, temperature=batches.temperature,
                              groups=groups)
                if round_index:
                    elapsed = time.perf_counter() - wall
                    times[name]["update_s"].append(elapsed)
                    times[name]["update_cpu_s"].append(time.process_time() - cpu)
                    times[name]["schedule_s"].append(elapsed - step_time["last"])
    finally:
        destroy_parallel()
    result = {"settings": vars(args) | {"budget": cfg.train.packing.max_tokens_per_microbatch},
              "load_average": os.getloadavg(), "variants": {}}
    for name, batches in variants.items():
        result["variants"][name] = {
            "microbatches": len(batches.microbatches),
            "processed_tokens": batches.processed_tokens, "real_tokens": batches.real_tokens,
            "padding_fraction": batches.padding_fraction,
            **{key: statistics.median(values) for key, values in times[name].items()},
        }
    packed, padded = result["variants"]["packed"], result["variants"]["padded"]
    token_ratio = packed["processed_tokens"] / padded["processed_tokens"]
    result["token_ratio"] = token_ratio
    result["schedule_time_ratio"] = packed["schedule_s"] / padded["schedule_s"]
    result["update_time_ratio"] = packed["update_s"] / padded["update_s"]
    result["goal_padding"] = packed["padding_fraction"] <= PADDING_GOAL
    result["goal_time"] = packed["schedule_s"] <= TIME_GOAL * (
        packed["real_tokens"] / padded["processed_tokens"]) * padded["schedule_s"]
    return result


def format_result(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        f"RL policy update, {s['sequences']} sequences: prompts {s['prompt_min']}-"
        f"{s['prompt_max']}, responses log-normal median {s['response_median']} (sigma "
        f"{s['response_sigma']}) capped at {s['response_cap']}; model {s['layers']} layers x "
        f"{s['hidden']}, vocab {s['vocab']}, {s['attention']}, LoGRA paper mode"
        f"{'' if s['no_kl_control'] else ' + KL control'}; padded to {s['seq_length']} x "
        f"{s['micro_batch_size']}, packed budget {s['budget']}",
        "",
        "| variant | microbatches | processed tokens | padding | update [s] | schedule [s] | "
        "update CPU [s] |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in result["variants"].items():
        lines.append(f"| {name} | {v['microbatches']} | {v['processed_tokens']:,} | "
                     f"{100 * v['padding_fraction']:.1f}% | {v['update_s']:.2f} | "
                     f"{v['schedule_s']:.2f} | {v['update_cpu_s']:.2f} |")
    load = ", ".join(f"{x:.1f}" for x in result["load_average"])
    packed, padded = result["variants"]["packed"], result["variants"]["padded"]
    real_share = packed["real_tokens"] / padded["processed_tokens"]
    lines += [
        "",
        f"tokens processed packed / padded: {result['token_ratio']:.3f} (real tokens / padded "
        f"tokens {real_share:.3f})",
        f"schedule time packed / padded: {result['schedule_time_ratio']:.3f}; goal <= "
        f"{TIME_GOAL} x {real_share:.3f} = {TIME_GOAL * real_share:.3f}: "
        f"{'met' if result['goal_time'] else 'NOT met'}",
        f"update time packed / padded (with the optimizer step and the KL probe): "
        f"{result['update_time_ratio']:.3f}",
        f"padding packed {100 * packed['padding_fraction']:.1f}% (goal <= "
        f"{100 * PADDING_GOAL:.0f}%: {'met' if result['goal_padding'] else 'NOT met'})",
        f"load average {load} (on {os.cpu_count()} CPUs)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
