"""The vLLM demo: RL with the rollout engine in its own process (vLLM), kept in step by low-rank
policy sync, and the bytes it ships against a full refit.

    make demo-vllm      (or: python tools/demo_vllm.py [--steps N] [--out DIR] [--max-staleness N])

A short RL run of the demo's model (``configs/demo_rl_cpu.yaml``: Llama-style, head width 32)
from its random initialisation, through the real CLI on CPU: the trainer is 2 processes at
TP=2, the rollout engine is vLLM at TP=1 in ``.venv-vllm`` (``make setup-vllm``), LoGRA paper
mode. At start the trainer writes its policy as a Hugging Face checkpoint for vLLM and syncs it
fully; after every update it ships per target layer the merged factor and the projection's seed
(``sync.mode=low_rank``), and compares digests of every served weight with its own
(``sync.check_interval=1``). It prints per step the bytes shipped, the bytes a full sync would
have shipped, the sync time and the weight check, then a summary. A second run of the same
seed with ``sync.mode=delta`` (the XOR of vLLM's served weights against the trainer's,
zstd-compressed: the field's sparse refit; ``--delta-steps 0`` skips it) then prints its bytes
per step beside the low-rank and full bytes (``tools/bench_sync_modes.py`` compares the modes on
the very same updates). ``--max-staleness 1``: vLLM generates each next batch while the trainer
updates (``rollout.max_staleness``, docs/async.md), in both runs; every step then also shows its
batch's staleness and how long the trainer waited for vLLM. Learning is ``make demo``'s claim,
not this one's: a few steps from a random start do not move accuracy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_logra.train.metrics import read_metrics  # noqa: E402
from tools.demo_cpu import DATA_DIR, _torchrun, ensure_dataset  # noqa: E402

OUT_DIR = REPO / "runs" / "demo_vllm"
# Few steps and a small evaluation keep the run to a few minutes on 2 idle cores (vLLM's start
# is ~30 s of it); every step's weights are checked against vLLM's.
OVERRIDES: tuple[str, ...] = (
    "rollout.placement=separate", "rollout.engine=vllm", "rollout.tp=1", "sync.mode=low_rank",
    "sync.check_interval=1", "rl.eval.interval=0", "rl.eval.prompts=64", "rl.eval.samples=2",
)


def print_sync(run_dir: Path) -> None:
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "sync_bytes" in r]
    print("\npolicy sync of the vLLM engine, per step (low-rank records vs a full refit)")
    print(f"{'step':>5} {'sync bytes':>12} {'full bytes':>12} {'ratio':>7} {'sync s':>8} "
          f"{'weights equal':>14} {'reward':>7} {'staleness':>9} {'waited s':>9}")
    for r in steps:
        match = r.get("sync_weights_match")
        print(f"{r['step']:>5} {r['sync_bytes']:>12,} {r['sync_full_bytes']:>12,} "
              f"{r['sync_bytes'] / r['sync_full_bytes']:>7.4f} {r['sync_time_s']:>8.3f} "
              f"{'-' if match is None else str(match):>14} {r['reward']:>7.3f} "
              f"{r['staleness']:>9} {r['trainer_idle_s']:>9.3f}")
    # The full sync at start ran before step 0's evaluation (the run's log has it); every step
    # here shipped low-rank records and the changed non-targets.
    later = steps
    checked = [r["sync_weights_match"] for r in steps if "sync_weights_match" in r]
    print(f"\nsummary: {len(steps)} steps; low-rank sync: median "
          f"{statistics.median(r['sync_bytes'] for r in later):,.0f} bytes per step vs "
          f"{later[0]['sync_full_bytes']:,} for a full refit "
          f"({statistics.median(r['sync_bytes'] / r['sync_full_bytes'] for r in later):.4f}x), "
          f"median sync time {statistics.median(r['sync_time_s'] for r in later):.3f} s; "
          f"vLLM's served weights equal the trainer's on {sum(checked)} of {len(checked)} "
          "checked steps")
    if not all(checked):
        raise SystemExit("the vLLM engine's weights differed from the trainer's")


def print_delta(low_rank_dir: Path, delta_dir: Path) -> None:
    low_rank = [r for r in read_metrics(low_rank_dir / "metrics.jsonl") if "sync_bytes" in r]
    delta = [r for r in read_metrics(delta_dir / "metrics.jsonl") if "sync_bytes" in r]
    print("\nthe same demo with sync.mode=delta (XOR of the served weights, zstd), per step")
    print(f"{'step':>5} {'low-rank B':>12} {'delta B':>12} {'changed':>8} {'full B':>12} "
          f"{'weights equal':>14}")
    for lr, d in zip(low_rank, delta, strict=False):
        print(f"{d['step']:>5} {lr['sync_bytes']:>12,} {d['sync_bytes']:>12,} "
              f"{d.get('sync_changed_fraction', 0):>8.2%} {d['sync_full_bytes']:>12,} "
              f"{str(d.get('sync_weights_match', '-')):>14}")
    print(f"\nmedian bytes per step: low-rank "
          f"{statistics.median(r['sync_bytes'] for r in low_rank):,.0f}, delta "
          f"{statistics.median(r['sync_bytes'] for r in delta):,.0f}, full "
          f"{delta[0]['sync_full_bytes']:,}")
    if not all(r.get("sync_weights_match", True) for r in delta):
        raise SystemExit("the delta-synced vLLM engine's weights differed from the trainer's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="RL steps (train.steps)")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="the run directory")
    parser.add_argument("--delta-steps", type=int, default=None,
                        help="steps of the sync.mode=delta run (default: --steps; 0: skip it)")
    parser.add_argument("--max-staleness", type=int, default=0,
                        help="rollout.max_staleness: 1 generates each next batch while the "
                             "trainer updates")
    args = parser.parse_args()
    started = time.perf_counter()
    ensure_dataset()
    run_dir = args.out.resolve()
    _torchrun("rl", [f"data.dir={DATA_DIR}", *OVERRIDES, f"train.steps={args.steps}",
                     f"rollout.max_staleness={args.max_staleness}", f"run.dir={run_dir}"],
              "RL with LoGRA, rollouts from a separate vLLM engine, low-rank sync")
    print_sync(run_dir)
    delta_steps = args.steps if args.delta_steps is None else args.delta_steps
    if delta_steps:
        delta_dir = run_dir.with_name(run_dir.name + "_delta")
        _torchrun("rl", [f"data.dir={DATA_DIR}", *OVERRIDES, "sync.mode=delta",
                         f"train.steps={delta_steps}",
                         f"rollout.max_staleness={args.max_staleness}", f"run.dir={delta_dir}"],
                  "the same with sync.mode=delta")
        print_delta(run_dir, delta_dir)
    print(f"\ndemo wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
