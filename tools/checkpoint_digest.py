"""Print a layout-independent digest of a checkpoint's full model weights.

    python tools/checkpoint_digest.py CHECKPOINT_DIR [--json]

The last line is ``digest <sha256>``: equal for two checkpoints exactly when their full
(unsharded) weights are bit-identical, whatever parallel layout wrote them. ``--json`` prints the
per-tensor norms (and the digest) as one JSON object instead, for comparisons within a tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="an iter_NNNNNNN directory")
    parser.add_argument("--json", action="store_true", help="print per-tensor norms as JSON")
    args = parser.parse_args()
    path = Path(args.checkpoint)
    if not (path / "metadata.json").is_file():
        print(f"checkpoint_digest: {path} is not a dist_checkpointing directory", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import torch.distributed as dist

    from megatron_logra.mcore.checkpointing.digest import (
        load_full_weights,
        tensor_norms,
        weights_digest,
    )

    # dist_checkpointing reads through torch.distributed: a world of one process.
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get(
        "MASTER_PORT", "29533"), "RANK": "0", "WORLD_SIZE": "1"})
    dist.init_process_group("gloo")
    try:
        weights = load_full_weights(path)
    finally:
        dist.destroy_process_group()
    digest = weights_digest(weights)
    if args.json:
        print(json.dumps({"digest": digest, "norms": tensor_norms(weights)}, indent=1))
    else:
        for key, norm in tensor_norms(weights).items():
            print(f"{key:60s} {tuple(weights[key].shape)!s:>20} norm {norm:.9g}")
        print(f"digest {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
