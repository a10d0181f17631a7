"""Bytes per update of low-rank vs full policy sync for the model of each run config.

    python tools/sync_bytes.py configs/qwen2.5-1.5b.yaml configs/qwen2.5-7b.yaml configs/dense-27b.yaml

For each config: the model's shape (as our trainer builds it), its ``logra.sketch_rank``, in bf16
and fp32 on the wire; paper mode (non-targets frozen: only the factors ship) and library mode
(Adam-trained embeddings, norms and biases ship dense too), against a full sync of every
weight. Payload bytes from :func:`megatron_logra.sync.sizes.sync_bytes` (headers add a few hundred
bytes per record). Then the engine's shadow of the targets per engine rank
(:func:`megatron_logra.sync.sizes.engine_shadow_bytes`): each rank keeps the fp32 masters of its
own TP shard (and, serving bf16, their bf16 cast), at the engine TP sizes that divide the
query groups. No torch needed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_logra.config import load_config
from megatron_logra.memory.shapes import shape_from_model_config
from megatron_logra.sync.sizes import engine_shadow_bytes, model_sync_bytes

GB = 1e9
ENGINE_TPS = (1, 2, 4, 8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    header = ("config", "wire", "params", "targets U", "targets full", "non-targets",
              "paper", "library", "full", "paper x", "library x")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for path in args.configs:
        cfg = load_config(path, [])
        shape = shape_from_model_config(cfg.model, vocab_size=cfg.model.vocab_size,
                                        name=path.stem)
        for wire in ("bf16", "fp32"):
            common = {"sketch_rank": cfg.logra.sketch_rank, "wire_dtype": wire}
            paper = model_sync_bytes(shape, non_targets_train=False, **common)
            library = model_sync_bytes(shape, non_targets_train=True, **common)
            full = paper["full_total"]
            row = (
                f"{path.stem} (r={cfg.logra.sketch_rank})", wire,
                f"{shape.total_parameters() / 1e9:.2f} B",
                f"{paper['targets_low_rank'] / GB:.3f} GB", f"{paper['targets_full'] / GB:.2f} GB",
                f"{library['non_targets_dense'] / GB:.3f} GB",
                f"{paper['low_rank_total'] / GB:.3f} GB", f"{library['low_rank_total'] / GB:.3f} GB",
                f"{full / GB:.2f} GB", f"{full / paper['low_rank_total']:.1f}",
                f"{full / library['low_rank_total']:.1f}",
            )
            lines.append("| " + " | ".join(row) + " |")
    header = ("config", "engine TP", "fp32 masters per rank", "with bf16 served copy")
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for path in args.configs:
        cfg = load_config(path, [])
        shape = shape_from_model_config(cfg.model, vocab_size=cfg.model.vocab_size,
                                        name=path.stem)
        for tp in (t for t in ENGINE_TPS if shape.num_query_groups % t == 0):
            fp32 = engine_shadow_bytes(shape, engine_tp=tp, served_dtype="fp32")
            bf16 = engine_shadow_bytes(shape, engine_tp=tp, served_dtype="bf16")
            lines.append(f"| {path.stem} | {tp} | {fp32['total'] / GB:.2f} GB | "
                         f"{bf16['total'] / GB:.2f} GB |")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
