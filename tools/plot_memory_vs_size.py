"""Plot estimated per-GPU training memory against model size for dense Adam, LoRA and LoGRA.

    python tools/plot_memory_vs_size.py                         # docs/memory_vs_size.png
    python tools/plot_memory_vs_size.py --precision fp32 --out docs/memory_vs_size_fp32.png
    python tools/plot_memory_vs_size.py --tp 4 --dp 2 --seq-length 2048 --out /tmp/m.png

The models are the shapes of the public Qwen2.5 family (0.5B to 72B: grouped-query attention,
SwiGLU, RMSNorm, q/k/v bias); the numbers come from the analytic estimator
(:mod:`megatron_logra.memory.estimate`, one GPU of the first pipeline stage) for one Megatron
layout and precision (``bf16``: Megatron mixed precision, LoGRA with fp32 master shards over
DP; ``fp32``: fp32 parameters for every method). Left: everything (persistent state + saved activations); right: persistent state only.
LoGRA is drawn in both of its modes: ``library`` (non-target parameters trained by Adam) and
``paper`` (non-targets frozen, as LoRA freezes them). The table the plot is drawn from is
printed too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_logra.memory.estimate import (  # noqa: E402
    GIB,
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

SERIES = ("dense Adam", "LoRA", "LoGRA library", "LoGRA paper")
STYLES = {"dense Adam": ("tab:red", "o", "-"), "LoRA": ("tab:blue", "s", "-"),
          "LoGRA library": ("tab:green", "^", "-"), "LoGRA paper": ("tab:green", "v", "--")}


LOGRA_PRECISION = {"bf16": "bf16_sharded_master", "fp32": "fp32"}


def estimates(shape: ModelShape, layout: Layout, rank: int,
              precision: str) -> dict[str, MemoryBreakdown]:
    """The four series for one model (distributed optimizer on)."""
    logra = LOGRA_PRECISION[precision]
    return {
        "dense Adam": dense_adam_memory(shape, layout, precision=precision),
        "LoRA": lora_memory(shape, layout, lora_rank=rank, precision=precision),
        "LoGRA library": logra_memory(shape, layout, sketch_rank=rank, non_targets="adam",
                                      precision=logra),
        "LoGRA paper": logra_memory(shape, layout, sketch_rank=rank, non_targets="frozen",
                                    precision=logra),
    }


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
    parser.add_argument("--precision", default="bf16", choices=sorted(LOGRA_PRECISION))
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
        table = [(shape, estimates(shape, layout, args.rank, args.precision))
                 for shape in FAMILY]
    except ValueError as error:
        parser.error(str(error))

    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    sizes = [shape.total_parameters() / 1e9 for shape, _ in table]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, part in zip(axes, ("total", "persistent"), strict=True):
        for series in SERIES:
            color, marker, line = STYLES[series]
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
    axes[0].legend()
    fig.suptitle(
        f"{'bf16 Megatron' if args.precision == 'bf16' else 'fp32 parameters'}, distributed "
        f"optimizer, tp={args.tp} dp={args.dp}"
        f"{' sp' if args.tp > 1 else ''}, {args.micro_batch_size} x {args.seq_length} tokens, "
        f"recompute {args.recompute}, LoRA rank = sketch rank = {args.rank}")
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)

    print(f"per-GPU memory estimate [GiB], total (persistent); {args.precision}, tp={args.tp} dp={args.dp} "
          f"seq {args.seq_length} recompute {args.recompute}, rank {args.rank}")
    print(f"{'model':<16}{'params':>9}" + "".join(f"{s:>22}" for s in SERIES))
    for shape, est in table:
        print(f"{shape.name:<16}{shape.total_parameters() / 1e9:>8.2f}B" + "".join(
            f"{est[s].total / GIB:>13.2f} ({est[s].persistent / GIB:>5.2f})" for s in SERIES))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
