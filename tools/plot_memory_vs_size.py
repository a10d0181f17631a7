"""Plot estimated per-GPU training memory against model size for dense Adam, LoRA and LoGRA.

    python tools/plot_memory_vs_size.py                         # docs/memory_vs_size.png
    python tools/plot_memory_vs_size.py --precision fp32 --out docs/memory_vs_size_fp32.png
    python tools/plot_memory_vs_size.py --tp 4 --dp 2 --seq-length 2048 --out m.png
    python tools/plot_memory_vs_size.py --master-weights remainder   # one LoGRA master mode

The models are the shapes of the public Qwen2.5 family (0.5B to 72B: grouped-query attention,
SwiGLU, RMSNorm, q/k/v bias); the numbers come from the analytic estimator
(:mod:`megatron_logra.memory.estimate`, one GPU of the first pipeline stage) for one Megatron
layout and precision (``bf16``: Megatron mixed precision, LoGRA with fp32 master shards over
DP; ``fp32``: fp32 parameters for every method). Left: everything (persistent state + saved
activations); right: persistent state only. LoGRA is drawn in both of its modes: ``library``
(non-target parameters trained by Adam) and ``paper`` (non-targets frozen, as LoRA freezes them),
and in bf16 for each master mode of ``--master-weights`` (``logra.master_weights``: fp32 master
rows on the GPU, int16 remainders, or fp32 rows in host memory -- host bytes are in no GPU
figure; the table gives them). The table the plot is drawn from is printed too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_logra.memory.estimate import (  # noqa: E402
    GIB,
    LOGRA_PRECISION_OF_MASTER_WEIGHTS,
    PRESETS,
    Layout,
    MemoryBreakdown,
    ModelShape,
    dense_adam_memory,
    logra_memory,
    lora_memory,
)


def _qwen(name: str, layers: int, hidden: int, ffn: int, heads: int, groups: int,
          head_dim: int, vocab: int, tied: bool) -> ModelShape:
    return ModelShape(name=name, num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn,
                      num_attention_heads=heads, num_query_groups=groups, head_dim=head_dim,
                      vocab_size=vocab, tied_embeddings=tied, gated_mlp=True, qkv_bias=True)


# The public Qwen2.5 configurations (1.5B and 7B are the estimator's presets).
FAMILY: tuple[ModelShape, ...] = (
    _qwen("qwen2.5-0.5b", 24, 896, 4864, 14, 2, 64, 151936, True),
    PRESETS["qwen2.5-1.5b"],
    _qwen("qwen2.5-3b", 36, 2048, 11008, 16, 2, 128, 151936, True),
    PRESETS["qwen2.5-7b"],
    _qwen("qwen2.5-14b", 48, 5120, 13824, 40, 8, 128, 152064, False),
    _qwen("qwen2.5-32b", 64, 5120, 27648, 40, 8, 128, 152064, False),
    _qwen("qwen2.5-72b", 80, 8192, 29568, 64, 8, 128, 152064, False),
)

BASELINES = ("dense Adam", "LoRA")
LOGRA_MODES = ("library", "paper")
MODE_COLORS = {"none": "tab:green", "dp_sharded": "tab:green", "remainder": "tab:olive",
               "host": "tab:cyan"}
BASELINE_STYLES = {"dense Adam": ("tab:red", "o", "-"), "LoRA": ("tab:blue", "s", "-")}
DEFAULT_MASTER_WEIGHTS = {"bf16": ("dp_sharded", "remainder", "host"), "fp32": ("none",)}
"""The LoGRA master modes drawn by default: each bf16 one; fp32 weights are their own masters."""


def series_names(master_weights: tuple[str, ...]) -> list[str]:
    return [*BASELINES, *(f"LoGRA {mode}/{master}" for master in master_weights
                          for mode in LOGRA_MODES)]


def style(series: str) -> tuple[str, str, str]:
    if series in BASELINE_STYLES:
        return BASELINE_STYLES[series]
    mode, master = series.removeprefix("LoGRA ").split("/")
    return MODE_COLORS[master], "^" if mode == "library" else "v", "-" if mode == "library" else "--"


def estimates(shape: ModelShape, layout: Layout, rank: int, precision: str,
              master_weights: tuple[str, ...]) -> dict[str, MemoryBreakdown]:
    """Every series for one model (distributed optimizer on)."""
    out = {
        "dense Adam": dense_adam_memory(shape, layout, precision=precision),
        "LoRA": lora_memory(shape, layout, lora_rank=rank, precision=precision),
    }
    for master in master_weights:
        for mode, non_targets in zip(LOGRA_MODES, ("adam", "frozen"), strict=True):
            out[f"LoGRA {mode}/{master}"] = logra_memory(
                shape, layout, sketch_rank=rank, non_targets=non_targets,
                precision=LOGRA_PRECISION_OF_MASTER_WEIGHTS[master])
    return out


def _master_weights(text: str | None, precision: str) -> tuple[str, ...]:
    if text is None:
        return DEFAULT_MASTER_WEIGHTS[precision]
    modes = tuple(m for m in text.split(",") if m)
    allowed = DEFAULT_MASTER_WEIGHTS[precision]
    for mode in modes:
        if mode not in allowed:
            raise ValueError(f"--master-weights contains {mode!r}; with --precision {precision} "
                             f"choose from {list(allowed)}")
    if not modes:
        raise ValueError("--master-weights is empty; name one or more of "
                         f"{list(allowed)}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--recompute", default="full", choices=("none", "selective", "full"))
    parser.add_argument("--rank", type=int, default=256, help="LoRA rank = LoGRA sketch rank")
    parser.add_argument("--precision", default="bf16", choices=sorted(DEFAULT_MASTER_WEIGHTS))
    parser.add_argument("--master-weights",
                        help="LoGRA's logra.master_weights, comma-separated (default: bf16 "
                        "dp_sharded,remainder,host; fp32 none)")
    parser.add_argument("--gpu-mem-gib", type=float, default=80.0)
    parser.add_argument("--out", default=str(REPO / "docs" / "memory_vs_size.png"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        layout = Layout(tp=args.tp, dp=args.dp, seq_length=args.seq_length,
                        micro_batch_size=args.micro_batch_size, sequence_parallel=args.tp > 1,
                        recompute=args.recompute)
        masters = _master_weights(args.master_weights, args.precision)
        table = [(shape, estimates(shape, layout, args.rank, args.precision, masters))
                 for shape in FAMILY]
    except ValueError as error:
        parser.error(str(error))

    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    sizes = [shape.total_parameters() / 1e9 for shape, _ in table]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, part in zip(axes, ("total", "persistent"), strict=True):
        for series in series_names(masters):
            color, marker, line = style(series)
            values = [getattr(est[series], part) / GIB for _, est in table]
            ax.plot(sizes, values, color=color, marker=marker, linestyle=line, label=series)
        ax.axhline(args.gpu_mem_gib, color="gray", linestyle=":", linewidth=1)
        ax.text(sizes[0], args.gpu_mem_gib * 1.08, f"{args.gpu_mem_gib:g} GiB", color="gray")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("model parameters [billions] (Qwen2.5 shapes)")
        ax.set_title("persistent state + activations" if part == "total"
                     else "persistent state only")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("per-GPU memory [GiB] (estimate)")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"{'bf16 Megatron' if args.precision == 'bf16' else 'fp32 parameters'}, distributed "
        f"optimizer, tp={args.tp} dp={args.dp}"
        f"{' sp' if args.tp > 1 else ''}, {args.micro_batch_size} x {args.seq_length} tokens, "
        f"recompute {args.recompute}, LoRA rank = sketch rank = {args.rank}"
        + ("\nLoGRA .../host: masters in host RAM, not in these GPU figures"
           if "host" in masters else ""))
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)

    print(f"per-GPU memory estimate [GiB], total (persistent); {args.precision}, tp={args.tp} dp={args.dp} "
          f"seq {args.seq_length} recompute {args.recompute}, rank {args.rank}")
    names = series_names(masters)
    print(f"{'model':<16}{'params':>9}" + "".join(f"{s:>26}" for s in names))
    for shape, est in table:
        print(f"{shape.name:<16}{shape.total_parameters() / 1e9:>8.2f}B" + "".join(
            f"{est[s].total / GIB:>17.2f} ({est[s].persistent / GIB:>6.2f})" for s in names))
    if "host" in masters:
        print("host RAM per GPU of the host masters [GiB]: " + ", ".join(
            f"{shape.name} {est['LoGRA library/host'].host_optimizer_state / GIB:.2f}"
            for shape, est in table))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
