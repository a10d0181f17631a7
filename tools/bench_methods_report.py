"""The comparison table of tools/bench_methods.py: one column per method, ratios of every LoGRA
column against dense Adam and LoRA.

Device memory and host memory are kept apart: LoGRA's host masters (``logra.master_weights=host``)
live beside the device, so they are in no device row; the ``host`` rows show them. On a CPU run
the two are the same memory and the split still says which bytes a GPU run would offload.
"""

from __future__ import annotations

import os
from typing import Any


def _mib(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def method_label(key: str) -> str:
    """``logra_paper@host`` -> ``LoGRA paper/host`` (column headers)."""
    base, _, mode = key.partition("@")
    name = {"dense_adam": "dense Adam", "lora": "LoRA", "logra": "LoGRA",
            "logra_paper": "LoGRA paper"}[base]
    return f"{name}/{mode}" if mode else name


def is_logra(key: str) -> bool:
    return key.partition("@")[0] in ("logra", "logra_paper")


def header_lines(results: dict[str, dict[str, Any]], args: Any, lora_rank: int,
                 lora_alpha: float, load: tuple[float, float, float]) -> list[str]:
    first = next(iter(results.values()))
    cfg = first["config"]
    experts = getattr(args, "moe_experts", 0)
    moe = (f"; every layer MoE: {experts} experts top-{args.moe_topk}, expert ffn "
           f"{args.moe_ffn or args.ffn}"
           + (f", shared expert ffn {args.moe_shared_ffn}" if args.moe_shared_ffn else "")
           + f", ep={args.ep}") if experts else ""
    return [
        f"model: {args.layers} layers, hidden {args.hidden}, ffn {args.ffn} (SwiGLU){moe}, "
        f"{args.heads} heads, vocab {args.vocab}; batch {args.microbatches} x "
        f"{args.micro_batch_size} x {args.seq_length} tokens per DP rank; tp={args.tp} "
        f"sp={'on' if args.sp else 'off'} on {args.procs} process(es), "
        f"{first['device']}, {first['torch_threads']} threads each",
        f"model.params_dtype={cfg['params_dtype']} model.attention={cfg['attention']} "
        f"model.recompute={cfg['recompute']}; LoGRA columns: logra.master_weights as named "
        f"(resolved: {', '.join(sorted({r['config']['master_weights'] for r in results.values() if r['config']['master_weights']}) or '-')})",
        f"methods: dense Adam | LoRA rank {lora_rank} (alpha {lora_alpha:g}, base frozen, Adam) "
        f"| LoGRA sketch rank {args.sketch_rank} (library: RowAdam on targets, Adam on the rest)"
        " | LoGRA paper (non-targets frozen, predicted-KL step control: probe JVP before the "
        "merge, realised-KL forward after it, both inside the timed step)",
        f"memory: {first['memory_source']}; time: {args.steps} steps per method after "
        f"{args.warmup} warm-up, methods in turn; load average {load[0]:.2f} on "
        f"{os.cpu_count()} CPUs (1 minute)",
    ]


def format_methods(results: dict[str, dict[str, Any]], args: Any, lora_rank: int,
                   lora_alpha: float, load: tuple[float, float, float]) -> str:
    names = list(results)
    width = max(14, *(len(method_label(n)) + 2 for n in names))
    lines = [*header_lines(results, args, lora_rank, lora_alpha, load), "",
             f"{'per device [MiB]':<40}" + "".join(f"{method_label(n):>{width}}" for n in names)]

    def row(label: str, values: list[str]) -> None:
        lines.append(f"{label:<40}" + "".join(f"{v:>{width}}" for v in values))

    def mib_row(label: str, get: Any) -> None:
        row(label, [_mib(get(results[n])) for n in names])

    mib_row("peak live tensors (measured)", lambda r: r["peak_bytes"])
    mib_row("  estimate: total", lambda r: r["estimate"]["total_bytes"])
    mib_row("persistent (measured, step start)", lambda r: r["persistent_bytes"])
    mib_row("  state_bytes (weights..projections)", lambda r: r["device_state_bytes"])
    mib_row("  estimate: persistent", lambda r: r["estimate"]["persistent_bytes"])
    categories = sorted({c for n in names for c in results[n]["peak_by_category"]})
    for category in categories:
        mib_row(f"  at peak: {category}", lambda r, c=category: r["peak_by_category"].get(c, 0))
    mib_row("  estimate: activations", lambda r: r["estimate"]["activations_bytes"])
    mib_row("host masters (measured, not device)", lambda r: r["host_bytes"])
    mib_row("  estimate: host", lambda r: r["estimate"]["host_bytes"])
    mib_row("peak RSS", lambda r: r["peak_rss_bytes"])
    mib_row("  RSS before the model", lambda r: r["baseline_rss_bytes"])
    for label, key in (("step time [s] (median)", "step_time_s"),
                       ("step time [s] (fastest)", "step_time_min_s"),
                       ("step CPU time [s] (median)", "step_cpu_time_s"),
                       ("  merge [s] (median)", "merge_time_s"),
                       ("  KL probe JVP [s] (median)", "kl_probe_time_s"),
                       ("  realised-KL forward [s] (median)", "kl_realised_time_s")):
        row(label, [f"{results[n][key]:.3f}" if results[n].get(key) is not None else "-"
                    for n in names])
    row("  KL probe share of the step",
        [f"{results[n]['kl_share']:.1%}" if results[n].get("kl_share") is not None else "-"
         for n in names])
    lines.append("")
    for name in names:
        if not is_logra(name):
            continue
        for other in ("dense_adam", "lora"):
            if other in results:
                lines.append(ratio_line(results[name], results[other], method_label(name),
                                        method_label(other)))
    return "\n".join(lines)


def ratios(mine: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    return {
        "peak_bytes": mine["peak_bytes"] / other["peak_bytes"],
        "persistent_bytes": mine["persistent_bytes"] / other["persistent_bytes"],
        "peak_rss_bytes": mine["peak_rss_bytes"] / other["peak_rss_bytes"],
        "step_time_s": mine["step_time_s"] / other["step_time_s"],
        "step_time_min_s": mine["step_time_min_s"] / other["step_time_min_s"],
        "step_cpu_time_s": mine["step_cpu_time_s"] / other["step_cpu_time_s"],
        "estimate_total_bytes": (mine["estimate"]["total_bytes"]
                                 / other["estimate"]["total_bytes"]),
        "estimate_persistent_bytes": (mine["estimate"]["persistent_bytes"]
                                      / other["estimate"]["persistent_bytes"]),
    }


def all_ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    return {f"{name}_over_{other}": ratios(results[name], results[other])
            for name in results if is_logra(name)
            for other in ("dense_adam", "lora") if other in results}


def ratio_line(mine: dict[str, Any], other: dict[str, Any], name: str, other_name: str) -> str:
    r = ratios(mine, other)
    return (f"{name} / {other_name}: peak {r['peak_bytes']:.3f} (estimate "
            f"{r['estimate_total_bytes']:.3f}), persistent {r['persistent_bytes']:.3f} "
            f"(estimate {r['estimate_persistent_bytes']:.3f}), peak RSS "
            f"{r['peak_rss_bytes']:.3f}, step time {r['step_time_s']:.3f} (median) / "
            f"{r['step_time_min_s']:.3f} (fastest), step CPU time {r['step_cpu_time_s']:.3f}")
