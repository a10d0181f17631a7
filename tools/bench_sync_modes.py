"""Bytes, engine memory and apply time of every policy-sync mode, on the same real updates.

    python tools/bench_sync_modes.py [--steps 4] [--out runs/bench_sync_modes.json]

One process (gloo, one rank), the demo's dataset (``make demo`` writes it; written here if
missing). For two models -- the demo's (``configs/demo_rl_cpu.yaml``'s shape) and a larger CPU
model -- bf16 and fp32 weights, and three step sizes per optimizer, it trains ``--steps`` real
language-model steps and, after each, builds what each sync mode would ship for that very update
and applies it to a real engine shadow (:class:`megatron_logra.sync.shadow.EngineShadow`, the
code both engines run), checking that the shadow then serves the trainer's weights bit for bit:

* **full**: every served weight (``full_sync_buckets``, as encoded);
* **delta**: the XOR of the served weights against the previous step's, zstd per tensor
  (``sync.mode=delta``, no shadow on the engine), with the fraction of elements that changed;
* **low-rank** (LoGRA): the step's records as ``PolicySync`` ships them (paper mode: the
  factors only); the engine keeps an fp32 shadow of the targets;
* **master delta** (LoGRA): the delta of the fp32 masters a low-rank engine holds -- what a
  delta costs where it must keep that shadow exact (``auto``'s alternative);
* **adapters** (LoRA): the bytes of every adapter's A and B, what an engine that applied
  adapters itself would receive (LoRA's own update; our engines serve the merged weights and
  receive them as delta or full).

Step sizes: LoGRA paper mode's ``update_ratio`` (the paper's 6e-5, and 3e-4, 1.5e-3), Adam's
and LoRA's ``optimizer.lr``; the measured update ratio ``|dW| / |W|`` of the target weights is
printed for every run, so the rows compare at equal movement. Engine memory: what the engine
holds for the mode (served weights; plus the fp32 shadow of the targets for low-rank). Apply
time: the engine's decode and apply of the step's records (median over steps; CPU, so compare
within a run: the machine's load is printed).

Then the same table extrapolated to the 1.5B / 7B / 27B presets (``configs/``): full and
low-rank from the shapes (:mod:`megatron_logra.sync.sizes`); delta as the larger model's
measured compressed bytes per target parameter at the matching update ratio times the preset's
target parameters (paper mode changes nothing else; the fraction of bf16 entries that flip depends on each entry's relative step, not
on the model's size, at a given update ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
from megatron_logra.memory.shapes import shape_from_model_config  # noqa: E402
from megatron_logra.sync.delta import delta_buckets  # noqa: E402
from megatron_logra.sync.records import combine_rank_records, full_sync_buckets  # noqa: E402
from megatron_logra.sync.shadow import EngineShadow  # noqa: E402
from megatron_logra.sync.sizes import model_sync_bytes  # noqa: E402
from megatron_logra.sync.wire import decode, encode  # noqa: E402
from tools.demo_cpu import DATA_DIR, ensure_dataset  # noqa: E402

OUT = REPO / "runs" / "bench_sync_modes.json"
SEQ, MICRO, GLOBAL = 32, 2, 4
BUCKET_BYTES = 256 * 1024 * 1024
MODELS: dict[str, list[str]] = {
    # configs/demo_rl_cpu.yaml's model at TP=1.
    "demo": ["model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4",
             "model.ffn_hidden_size=512"],
    "larger": ["model.num_layers=4", "model.hidden_size=512", "model.num_attention_heads=8",
               "model.ffn_hidden_size=1536"],
}
COMMON = ["parallel.device=cpu", "model.activation=swiglu", "model.normalization=RMSNorm",
          "model.add_bias_linear=false", f"model.seq_length={SEQ}",
          f"train.micro_batch_size={MICRO}", f"train.global_batch_size={GLOBAL}",
          "optimizer.lr_warmup_steps=0", "optimizer.lr_decay_style=constant",
          "optimizer.clip_grad=1.0"]
# (optimizer, step-size override): three per optimizer, the paper's update ratio among LoGRA's.
RUNS: list[tuple[str, list[str]]] = [
    *[("logra", ["logra.mode=paper", "logra.sketch_rank=16", "logra.update_factor_dtype=bf16",
                 f"logra.update_ratio={r}"]) for r in ("6e-5", "3e-4", "1.5e-3")],
    *[("adam", [f"optimizer.lr={lr}"]) for lr in ("1e-6", "1e-5", "1e-4")],
    *[("lora", ["lora.lora_rank=16", f"optimizer.lr={lr}"]) for lr in ("1e-5", "1e-4", "1e-3")],
]
PRESET_CONFIGS = ("qwen2.5-1.5b", "qwen2.5-7b", "dense-27b")


def _encoded(records, wire_dtype: str = "fp32") -> list[bytes]:
    return [encode(r, wire_dtype=wire_dtype) for r in records]


def _apply(engine: EngineShadow, payloads: list[bytes]) -> float:
    start = time.perf_counter()
    for payload in payloads:
        engine.apply(decode(payload))
    return time.perf_counter() - start


def _update_ratio(new: dict, old: dict, names) -> float:
    num = sum(float((new[n].double() - old[n].double()).norm() ** 2) for n in names)
    den = sum(float(old[n].double().norm() ** 2) for n in names)
    return (num / den) ** 0.5 if den else 0.0


def run_one(model: str, dtype: str, optimizer: str, step_overrides: list[str], steps: int,
            groups) -> dict:
    from megatron_logra.mcore.models.gpt import build_model_chunks
    from megatron_logra.mcore.models.sync_state import exact_state, served_weights
    from megatron_logra.mcore.peft.lora import lora_adapters
    from megatron_logra.mcore.training.setup import setup_training
    from megatron_logra.mcore.training.step import train_step

    cfg = load_config(None, [*COMMON, *MODELS[model], f"model.params_dtype={dtype}",
                             f"optimizer.name={optimizer}", *step_overrides,
                             f"data.dir={DATA_DIR}"]).resolved(1)
    tokenizer = load_tokenizer(cfg.data.dir)
    schedule = LMBatchSchedule(load_tokens(cfg.data.dir), seq_length=SEQ,
                               global_batch_size=GLOBAL, seed=cfg.train.seed)
    chunks = build_model_chunks(cfg, groups, tokenizer.vocab_size)
    setup = setup_training(cfg, chunks, groups)
    served_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    records: list = []
    targets: list[str] = []
    if setup.logra is not None:
        setup.logra.update_listener = records.extend
        targets = [f"{t.layer_key}.weight" for t in setup.logra.targets]
    world = torch.distributed.group.WORLD

    served = served_weights(setup.model_chunks, groups)
    exact = exact_state(setup, groups, world) if targets else served
    delta_engine = EngineShadow([], served_dtype=served_dtype)
    delta_engine.apply(decode(encode(full_sync_buckets(served, update_count=0,
                                                       bucket_bytes=BUCKET_BYTES)[0],
                                     wire_dtype="fp32")))
    low_rank_engine = None
    if targets:
        low_rank_engine = EngineShadow(targets, served_dtype=served_dtype)
        for bucket in full_sync_buckets(exact, update_count=0, bucket_bytes=BUCKET_BYTES):
            low_rank_engine.apply(decode(encode(bucket, wire_dtype="fp32")))
    weight_names = targets or [n for n in served if n.endswith(
        ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight"))]
    counts = dict.fromkeys(served, 0)
    master_counts = dict.fromkeys(exact, 0)
    per_step = []
    for step in range(1, steps + 1):
        train_step(setup, schedule.microbatches(step, dp_rank=0, dp_size=1,
                                                micro_batch_size=MICRO),
                   groups=groups, seq_length=SEQ, micro_batch_size=MICRO)
        new = served_weights(setup.model_chunks, groups)
        row = {"update_ratio": _update_ratio(new, served, weight_names)}
        row["full_bytes"] = sum(len(p) for p in _encoded(
            full_sync_buckets(new, update_count=step, bucket_bytes=BUCKET_BYTES)))
        start = time.perf_counter()
        buckets = delta_buckets(new, served, counts, update_count=step,
                                bucket_bytes=BUCKET_BYTES)
        payloads = _encoded(buckets)
        row["delta_encode_s"] = time.perf_counter() - start
        row["delta_bytes"] = sum(len(p) for p in payloads)
        changed = sum(t.changed for b in buckets for t in b.tensors.values())
        row["changed_fraction"] = changed / sum(t.numel() for t in new.values())
        row["delta_apply_s"] = _apply(delta_engine, payloads)
        assert all(torch.equal(delta_engine.served[n], t) for n, t in new.items())
        counts.update({n: step for b in buckets for n in b.tensors})
        if targets:
            combined = combine_rank_records([list(records)])
            records.clear()
            payloads = _encoded(combined, "bf16")  # paper mode's bf16 factors: exact in bf16
            row["low_rank_bytes"] = sum(len(p) for p in payloads)
            row["low_rank_apply_s"] = _apply(low_rank_engine, payloads)
            assert all(torch.equal(low_rank_engine.served[n], new[n]) for n in targets)
            new_exact = exact_state(setup, groups, world)
            master = delta_buckets(new_exact, exact, master_counts, update_count=step,
                                   bucket_bytes=BUCKET_BYTES)
            row["master_delta_bytes"] = sum(len(p) for p in _encoded(master))
            master_counts.update({n: step for b in master for n in b.tensors})
            exact = new_exact
        if optimizer == "lora":
            row["adapter_bytes"] = sum(p.numel() * p.element_size()
                                       for a in lora_adapters(setup.model_chunks)
                                       for p in (a.a, a.b))
        served = new
        per_step.append(row)
    params = sum(t.numel() for t in served.values())
    memory = {"served": delta_engine.nbytes()}
    if low_rank_engine is not None:
        memory["low_rank_shadow"] = low_rank_engine.nbytes()
    return {"model": model, "dtype": dtype, "optimizer": optimizer,
            "step": " ".join(step_overrides), "params": params,
            "target_params": sum(served[n].numel() for n in weight_names),
            "engine_memory": memory, "steps": per_step}


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def table(results: list[dict]) -> str:
    header = ("model", "dtype", "optimizer", "step size", "update ratio", "changed", "full",
              "delta", "low-rank", "master delta", "adapters", "engine: served",
              "low-rank shadow", "apply delta s", "apply low-rank s")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def kb(value: float | None) -> str:
        return "-" if value is None else f"{value / 1e3:,.1f} kB"

    for r in results:
        rows = r["steps"]
        step = r["step"].split()[-1].split("=")[-1]
        lr_apply = _median(rows, "low_rank_apply_s")
        lines.append("| " + " | ".join((
            r["model"], r["dtype"], r["optimizer"], step,
            f"{_median(rows, 'update_ratio'):.1e}", f"{_median(rows, 'changed_fraction'):.2%}",
            kb(_median(rows, "full_bytes")), kb(_median(rows, "delta_bytes")),
            kb(_median(rows, "low_rank_bytes")), kb(_median(rows, "master_delta_bytes")),
            kb(_median(rows, "adapter_bytes")), kb(r["engine_memory"]["served"]),
            kb(r["engine_memory"].get("low_rank_shadow")),
            f"{_median(rows, 'delta_apply_s'):.4f}",
            "-" if lr_apply is None else f"{lr_apply:.4f}")) + " |")
    return "\n".join(lines)


def presets(results: list[dict]) -> str:
    """Full / delta / low-rank per update at the presets' shapes (bf16 served, paper mode)."""
    header = ("preset", "params", "update ratio (measured)", "full bf16", "delta bf16 (est.)",
              "low-rank bf16 factors", "delta / low-rank")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    larger = [r for r in results if r["model"] == "larger" and r["dtype"] == "bf16"
              and r["optimizer"] == "logra"]
    for name in PRESET_CONFIGS:
        cfg = load_config(REPO / "configs" / f"{name}.yaml", [])
        shape = shape_from_model_config(cfg.model, vocab_size=cfg.model.vocab_size, name=name)
        sizes = model_sync_bytes(shape, sketch_rank=cfg.logra.sketch_rank, wire_dtype="bf16",
                                 non_targets_train=False)
        params = shape.total_parameters()
        target_params = sizes["targets_full"] // 2  # bf16 bytes -> parameters
        for r in larger:
            # Paper mode changes the targets only: bytes per target parameter, times the
            # preset's target parameters.
            delta = _median(r["steps"], "delta_bytes") / r["target_params"] * target_params
            lines.append("| " + " | ".join((
                f"{name} (r={cfg.logra.sketch_rank})", f"{params / 1e9:.2f} B",
                f"{_median(r['steps'], 'update_ratio'):.1e}",
                f"{sizes['full_total'] / 1e9:.2f} GB", f"{delta / 1e9:.2f} GB",
                f"{sizes['low_rank_total'] / 1e9:.3f} GB",
                f"{delta / sizes['low_rank_total']:.1f}x")) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps per run")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--tables-from", type=Path, default=None,
                        help="print the tables of a saved --out file instead of measuring")
    args = parser.parse_args(argv)
    if args.tables_from is not None:
        results = json.loads(args.tables_from.read_text())
        print(table(results) + "\n\n" + presets(results))
        return 0
    ensure_dataset()
    from megatron_logra.mcore.process_groups import init_parallel

    load = os.getloadavg()
    groups = None
    results = []
    started = time.perf_counter()
    for model in args.models:
        for dtype in ("bf16", "fp32"):
            for optimizer, overrides in RUNS:
                if groups is None:
                    first = load_config(None, [*COMMON, *MODELS[model],
                                               f"data.dir={DATA_DIR}"]).resolved(1)
                    groups = init_parallel(first)
                results.append(run_one(model, dtype, optimizer, overrides, args.steps, groups))
                print(f"{model} {dtype} {optimizer} {' '.join(overrides)}: done "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nload average at start {load[0]:.1f}, at end {os.getloadavg()[0]:.1f}; "
          f"{args.steps} steps per run; medians over the steps\n")
    print(table(results))
    if "larger" in args.models:
        print("\nExtrapolated to the presets (bf16 served, LoGRA paper mode; delta from the larger "
              "model's bytes per target parameter at each update ratio):\n")
        print(presets(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
