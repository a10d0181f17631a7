"""Time one LoGRA merge of a bf16 weight through each master store (logra.master_weights).

    python tools/bench_master_merge.py --rows 4096 --cols 4096 --sketch-rank 256 --device cuda
    python tools/bench_master_merge.py --json          # the same figures as one JSON object

One weight ``[rows, cols]`` owned whole by this process (dp = 1), one update ``-lr D A`` of sketch
rank r per merge; the median wall time of ``--repeats`` merges per store, the device
synchronised around each. First, ``agreement``: AGREEMENT_MERGES merges (with weight decay) of
the same updates from the same start through every store, each store's fp32 masters and bf16
weight compared with ``dp_sharded``'s: bit-identical or not, and the largest distance of a
master element in fp32 units in the last place (on CPU the stores are bit-identical by the
chunk alignment, tests/unit/test_master_weights.py; a GPU's GEMM may choose its kernel by the
chunk's row count, which the host store's chunks change). ``fp32 addmm`` is the update alone (the ``none`` mode's merge into an
fp32 weight), the floor every store pays. On a GPU the host store streams its rows through the
device in ``--chunk-mib`` chunks with the copies overlapped; on CPU host and device are one
memory, so its figure there is the chunked arithmetic only.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from megatron_logra.master_weights import HostMasters, RemainderMaster, RowShardedMaster
from megatron_logra.row_sharding import RowShard


def _median_seconds(work: Callable[[], None], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


AGREEMENT_MERGES = 3


def _agreement(start: torch.Tensor, stores: dict[str, Callable], shard: RowShard, *,
               sketch_rank: int, device: torch.device) -> dict[str, dict[str, object]]:
    """Each store's masters and weight after the same merges, against ``dp_sharded``'s."""
    generator = torch.Generator().manual_seed(1)
    updates = [(torch.randn(start.shape[0], sketch_rank, generator=generator).to(device),
                (torch.randn(sketch_rank, start.shape[1], generator=generator)
                 / sketch_rank**0.5).to(device)) for _ in range(AGREEMENT_MERGES)]
    results = {}
    for name, make in stores.items():
        weight = start.clone()
        master = make(weight, shard)
        for direction, projection in updates:
            master.merge_(weight, direction, projection, lr=1e-3, weight_decay=0.1,
                          dp_group=None)
        results[name] = (weight, master.fp32_rows().clone())
    want_weight, want_rows = results["dp_sharded"]
    out = {}
    for name, (weight, rows) in results.items():
        ulps = (rows.view(torch.int32).long() - want_rows.view(torch.int32).long()).abs().max()
        out[name] = {"bit_identical": bool(torch.equal(weight, want_weight)
                                           and torch.equal(rows.view(torch.int32),
                                                           want_rows.view(torch.int32))),
                     "max_master_ulps": int(ulps)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--sketch-rank", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--chunk-mib", type=float, default=64.0,
                        help="the host store's chunk (logra.merge_chunk_mib)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(args.rows, args.cols, generator=generator).to(torch.bfloat16).to(device)
    direction = torch.randn(args.rows, args.sketch_rank, generator=generator).to(device)
    projection = (torch.randn(args.sketch_rank, args.cols, generator=generator)
                  / args.sketch_rank**0.5).to(device)
    shard = RowShard(args.rows, stride=1, dp_size=1, dp_rank=0)
    host = HostMasters(int(args.chunk_mib * 2**20))  # the store the product builds, its chunking
    chunk_rows = host.make(start, shard).chunk_rows
    fp32 = start.float()
    rows = {"fp32 addmm (none)": _median_seconds(
        lambda: fp32.addmm_(direction, projection, alpha=-1e-3), args.repeats, device)}
    stores = {
        "dp_sharded": RowShardedMaster,
        "remainder": RemainderMaster,
        f"host ({chunk_rows} rows/chunk)": host.make,
    }
    agreement = _agreement(start, {n.split(" ")[0]: m for n, m in stores.items()}, shard,
                           sketch_rank=args.sketch_rank, device=device)
    agreement = _agreement(start, {n.split(" ")[0]: m for n, m in stores.items()}, shard,
                           sketch_rank=args.sketch_rank, device=device)
    for name, make in stores.items():
        weight = start.clone()
        master = make(weight, shard)
        rows[name] = _median_seconds(
            lambda weight=weight, master=master: master.merge_(
                weight, direction, projection, lr=1e-3, weight_decay=0.0, dp_group=None),
            args.repeats, device)
    if args.json:
        print(json.dumps({"rows": args.rows, "cols": args.cols,  # noqa: T201
                          "sketch_rank": args.sketch_rank, "device": str(device),
                          "repeats": args.repeats, "chunk_rows": chunk_rows,
                          "merge_ms": {name: s * 1e3 for name, s in rows.items()},
                          "agreement": agreement}))
        return
    print(f"merge of a [{args.rows}, {args.cols}] bf16 weight, r={args.sketch_rank}, "  # noqa: T201
          f"{device}, median of {args.repeats}:")
    for name, seconds in rows.items():
        print(f"  {name:<28} {seconds * 1e3:9.2f} ms")  # noqa: T201
    print(f"after {AGREEMENT_MERGES} merges, against dp_sharded:")  # noqa: T201
    for name, figures in agreement.items():
        print(f"  {name:<28} bit-identical {figures['bit_identical']}, largest master "  # noqa: T201
              f"difference {figures['max_master_ulps']} ulp")


if __name__ == "__main__":
    main()
