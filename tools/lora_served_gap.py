"""What serving LoRA merged costs: the log-prob gap between the trainer's LoRA forward and the
merged weights a separate engine serves, against one step's own change of the policy.

    python tools/lora_served_gap.py [--steps 8] [--out runs/lora_served_gap.json]

A separate engine (the Megatron engine, vLLM) serves a plain model: for LoRA the trainer ships
``W + (alpha/r) B A`` (``megatron_logra.mcore.models.sync_state.served_weights``: fp32 products,
one rounding to the weight's dtype), while the trainer computes ``W x + (alpha/r) B (A x)``. The
two agree to rounding: in fp32 a few ulps of the logits, in bf16 half an ulp of every merged
entry (2^-9 relative) -- which is larger than what a LoRA step moves an entry by, so much of
the adapters' update is not in the served bf16 weights until it adds up to half an ulp.

One process (gloo, one rank), the demo's dataset (written if missing). For the demo's model and a
larger CPU model, bf16 and fp32 weights and three learning rates, it trains ``--steps`` real
language-model steps of LoRA, then scores one held-out batch of windows (temperature 1) with the
trainer's LoRA forward before and after the last step and with the merged served weights (the
same model with ``W`` replaced by the merged weight and ``B`` zeroed: the branch then adds exact
zeros). It prints per run:

* ``gap max`` / ``gap mean``: ``|log p_served - log p_trainer|`` over the batch's tokens, its
  maximum and mean, and the mean signed gap (what ``rollout_trainer_gap`` averages);
* ``step mean``: ``|log p_trainer(after) - log p_trainer(before)|``, one step's own change;
* ``unmoved``: the fraction of the targets' served entries still equal to the base weight ``W``
  (bf16: the merge rounded the whole adapter update away there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402

from megatron_logra.config import load_config  # noqa: E402
from megatron_logra.data.dataset_dir import load_tokenizer, load_tokens  # noqa: E402
from megatron_logra.data.lm_batches import LMBatchSchedule  # noqa: E402
from tools.bench_sync_modes import COMMON, GLOBAL, MICRO, MODELS, SEQ  # noqa: E402
from tools.demo_cpu import DATA_DIR, ensure_dataset  # noqa: E402

OUT = REPO / "runs" / "lora_served_gap.json"
LORA = ["optimizer.name=lora", "lora.lora_rank=16"]
LEARNING_RATES = ("1e-5", "1e-4", "1e-3")
SCORED_WINDOWS = 16


def _scored_batch(schedule: LMBatchSchedule, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of global batches the run does not train on (the steps after its last)."""
    indices = [i for step in range(steps + 1, steps + 1 + SCORED_WINDOWS // GLOBAL)
               for i in schedule.global_batch_indices(step)]
    window, _ = schedule.windows(indices)
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def run_one(model: str, dtype: str, lr: str, steps: int, groups) -> dict:
    from megatron_logra.mcore import compute_token_logprobs
    from megatron_logra.mcore.models.gpt import build_model_chunks
    from megatron_logra.mcore.models.sharding import global_named_parameters
    from megatron_logra.mcore.models.sync_state import served_weights
    from megatron_logra.mcore.peft.lora import lora_adapters
    from megatron_logra.mcore.training.setup import setup_training
    from megatron_logra.mcore.training.step import train_step

    cfg = load_config(None, [*COMMON, *MODELS[model], f"model.params_dtype={dtype}", *LORA,
                             f"optimizer.lr={lr}", f"data.dir={DATA_DIR}"]).resolved(1)
    tokenizer = load_tokenizer(cfg.data.dir)
    schedule = LMBatchSchedule(load_tokens(cfg.data.dir), seq_length=SEQ,
                               global_batch_size=GLOBAL, seed=cfg.train.seed)
    setup = setup_training(cfg, build_model_chunks(cfg, groups, tokenizer.vocab_size), groups)
    tokens_BL, labels_BL = _scored_batch(schedule, steps)

    def logprobs() -> torch.Tensor:
        return compute_token_logprobs(setup.model_chunks, tokens_BL, labels_BL, temperature=1.0,
                                      vocab_size=tokenizer.vocab_size, groups=groups,
                                      micro_batch_size=MICRO).double()

    before = None
    for step in range(1, steps + 1):
        if step == steps:
            before = logprobs()
        train_step(setup, schedule.microbatches(step, dp_rank=0, dp_size=1,
                                                micro_batch_size=MICRO),
                   groups=groups, seq_length=SEQ, micro_batch_size=MICRO)
    trainer = logprobs()
    served = served_weights(setup.model_chunks, groups)
    params = {name: p for chunk in setup.model_chunks
              for name, p in global_named_parameters(chunk)}
    adapters = lora_adapters(setup.model_chunks)
    kept, unmoved, entries = [], 0, 0
    with torch.no_grad():
        for adapter in adapters:  # the plain model the engine serves: W merged, no branch
            weight = params[f"{adapter.layer_key}.weight"]
            merged = served[f"{adapter.layer_key}.weight"]
            unmoved += int((merged == weight.detach().cpu()).sum())
            entries += merged.numel()
            kept.append((weight, weight.detach().clone(), adapter.b, adapter.b.detach().clone()))
            weight.copy_(merged)
            adapter.b.zero_()
        engine = logprobs()
        for weight, w, b_param, b in kept:
            weight.copy_(w)
            b_param.copy_(b)
    assert torch.equal(logprobs(), trainer)  # restored
    gap, step_change = engine - trainer, trainer - before
    return {"model": model, "dtype": dtype, "lr": lr, "tokens": gap.numel(),
            "gap_max": float(gap.abs().max()), "gap_mean": float(gap.abs().mean()),
            "gap_signed_mean": float(gap.mean()), "step_mean": float(step_change.abs().mean()),
            "step_max": float(step_change.abs().max()), "unmoved": unmoved / entries}


def table(results: list[dict]) -> str:
    rows = ["| model | dtype | lr | gap max | gap mean | gap signed mean | step mean | "
            "gap mean / step mean | unmoved |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['model']} | {r['dtype']} | {r['lr']} | {r['gap_max']:.2e} | "
                    f"{r['gap_mean']:.2e} | {r['gap_signed_mean']:+.1e} | {r['step_mean']:.2e} "
                    f"| {r['gap_mean'] / r['step_mean']:.3g} | {r['unmoved']:.1%} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="LoRA steps per run (>= 1)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be at least 1")
    ensure_dataset()
    from megatron_logra.mcore.process_groups import init_parallel

    load = os.getloadavg()
    groups = init_parallel(load_config(None, [*COMMON, *MODELS[args.models[0]],
                                              f"data.dir={DATA_DIR}"]).resolved(1))
    results, started = [], time.perf_counter()
    for model in args.models:
        for dtype in ("bf16", "fp32"):
            for lr in LEARNING_RATES:
                results.append(run_one(model, dtype, lr, args.steps, groups))
                print(f"{model} {dtype} lr={lr}: done ({time.perf_counter() - started:.0f} s)",
                      flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nload average at start {load[0]:.1f}, at end {os.getloadavg()[0]:.1f}; "
          f"{args.steps} LoRA steps (rank 16) per run, {SCORED_WINDOWS} held-out windows of "
          f"{SEQ} tokens scored\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
