"""Bytes per update of low-rank vs full policy sync for the model of each run config.

    python tools/sync_bytes.py configs/qwen2.5-1.5b.yaml configs/qwen2.5-7b.yaml configs/dense-27b.yaml

For each config: the model's shape (as our trainer builds it), its ``logra.sketch_rank``, in bf16
and fp32 on the wire; paper mode (non-targets frozen: only the factors ship) and library mode
(Adam-trained embeddings, norms and biases ship dense too), against a full sync of every
weight. Payload bytes from :func:`megatron_logra.sync.sizes.sync_bytes` (headers add a few hundred
bytes per record). No torch needed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_logra.config import load_config
from megatron_logra.memory.shapes import shape_from_model_config
from megatron_logra.sync.sizes import model_sync_bytes

GB = 1e9


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
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
