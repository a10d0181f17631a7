"""The KL probe's time: its forward-mode pass against a plain forward, and its share of a step.

    python tools/bench_kl_probe.py                        # the RL-like bench shape, 1 x 2048, fp32
    python tools/bench_kl_probe.py --seq-length 8192 --steps 1
    python tools/bench_kl_probe.py --profile              # where the forward-mode pass spends time
    python tools/bench_kl_probe.py --microbatches 8 --probe-responses 1 --steps 1

Paper mode under predicted-KL step control (the paper's method as it runs) on one process, CPU
by default: hidden 1024, 8 layers, 8 heads, SwiGLU FFN 4096, vocabulary 1024,
``--microbatches`` sequences per step (one by default), ``--probe-responses`` of them probed at
every position (one by default: the probe is then the whole batch; in RL it is
``probe_responses`` of hundreds of responses). Per measured step, in the same run (so that the machine's load affects both sides
alike):

* ``step``: the training step (forward, backward, the optimizer's step with the probe's
  forward-mode pass inside it) plus the realised-KL pass after it, as the trainers run it;
* ``jvp``: the probe's forward-mode pass and predicted KL (the step scale's call);
* ``realised``: the realised-KL pass (a plain forward per piece and the KL);
* ``forward``: a plain forward of the same probe pieces (eval, no grad), the reference.

Prints the medians, ``jvp / forward`` (the goal: <= 2.5), the probe's share of the measured step
(``(jvp + realised) / step``) and its share of a step at the paper's ratio -- 2 probed of 32
responses per rank (global batch 128 on 4 GPUs) -- composed from the same run's per-sequence
costs of training and of probing, and with ``--profile`` the operators of one forward-mode
pass by self CPU time beside a plain forward's. Report ``uptime`` with the figures: the ratios hold
under load, the seconds do not. With ``--device cuda`` it also reports
``torch.cuda.max_memory_allocated`` of the step's forward and backward, of the probe's
forward-mode pass and of the realised-KL pass (the GPU check's ``kl_probe`` section: the probe
must not set the step's peak).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--sketch-rank", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=1,
                        help="sequences of --seq-length per step, one microbatch each")
    parser.add_argument("--probe-responses", type=int, default=1,
                        help="sequences of the step in the KL probe (evenly spaced)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3,
                        help="after the steps: forward-mode passes and plain forwards of the "
                        "last proposal, alternated, this many times each (their fastest "
                        "ratio is the least disturbed by load)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--profile", action="store_true",
                        help="profile one forward-mode pass and one plain forward")
    parser.add_argument("--json", action="store_true")
    return parser


def _bench_args(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments tools/bench_methods_run.py's config builder reads."""
    return argparse.Namespace(
        layers=args.layers, hidden=args.hidden, heads=args.heads, ffn=args.ffn,
        vocab=args.vocab, seq_length=args.seq_length, micro_batch_size=1,
        microbatches=args.microbatches,
        recompute="none", attention="sdpa", dtype=args.dtype, moe_experts=0,
        sketch_rank=args.sketch_rank, lora_rank=None, lora_alpha=None, lr=1e-4,
        master_weights=None, tp=1, sp=False, device=args.device, warmup=args.warmup,
        steps=args.steps)


class _TimedScale:
    """The step control, timed (the optimizer calls it inside ``step()``); on CUDA also the
    peak allocated before it (the step's forward and backward) and during it."""

    def __init__(self, inner: Any, device: Any) -> None:
        self.inner, self.device, self.seconds = inner, device, 0.0
        self.peaks: dict[str, int] = {}
        self.proposal: Any = None

    def __call__(self, proposal: Any) -> float:
        self.peaks["forward_backward"] = _peak(self.device)
        self.proposal = proposal
        _sync(self.device)
        start = time.perf_counter()
        alpha = self.inner(proposal)
        _sync(self.device)
        self.seconds = time.perf_counter() - start
        self.peaks["kl_probe"] = _peak(self.device)
        return alpha

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def _sync(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def _peak(device: Any) -> int:
    """The peak allocated since the last call (CUDA), then a new window; 0 on CPU."""
    if device.type != "cuda":
        return 0
    import torch

    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak


PAPER_PROBED, PAPER_PER_RANK = 2, 32
"""The paper's probe: 2 of each rank's 32 responses (global batch 128 on 4 GPUs)."""


def _share_at_ratio(row: dict[str, float], sequences: int, probed: int) -> float:
    """The probe's share of a step that trains :data:`PAPER_PER_RANK` sequences and probes
    :data:`PAPER_PROBED`, from this step's per-sequence costs of training and of probing."""
    probe = (row["jvp"] + row["realised"]) / probed
    train = (row["step"] - row["jvp"] - row["realised"]) / sequences
    return PAPER_PROBED * probe / (PAPER_PER_RANK * train + PAPER_PROBED * probe)


def _plain_forward(control: Any) -> None:
    """The model's own forward of each probe piece, its output layer included."""
    from megatron_logra.mcore.kl_probe.logit_jvp import probe_logits

    for piece in control.pieces:
        probe_logits(control.model_chunks, piece.tokens, piece.position_ids,
                     pipeline=control.pipeline)


def _profile(fn: Any, rows: int = 18) -> str:
    from torch.profiler import profile

    with profile() as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from bench_methods_run import method_config, microbatches

    from megatron_logra.mcore.models.gpt import build_model_chunks
    from megatron_logra.mcore.process_groups import destroy_parallel, init_parallel
    from megatron_logra.mcore.training.setup import setup_training
    from megatron_logra.mcore.training.step import train_step
    from megatron_logra.probe_batch import supervised_probe_batch

    torch.set_num_threads(args.threads)
    bench = _bench_args(args)
    cfg = method_config(bench, "logra_paper", 1)
    probe_settings = dataclasses.replace(cfg.logra.kl_control,
                                         probe_responses=args.probe_responses)
    groups = init_parallel(cfg)
    try:
        chunks = build_model_chunks(cfg, groups, vocab_size=args.vocab)
        setup = setup_training(cfg, chunks, groups, kl_vocab_size=args.vocab)
        control = setup.kl_control
        timed = _TimedScale(control, groups.device)
        setup.logra.step_scale = timed
        batch = microbatches(bench, groups, groups.device)
        rows = []
        for index in range(args.warmup + args.steps):
            control.set_batch(supervised_probe_batch(batch, probe_settings, dp_rank=0,
                                                     dp_size=1))
            _peak(groups.device)
            start = time.perf_counter()
            train_step(setup, batch, groups=groups, seq_length=args.seq_length,
                       micro_batch_size=1)
            _sync(groups.device)
            trained = time.perf_counter()
            merge_peak = _peak(groups.device)
            control.realised()
            _sync(groups.device)
            realised = time.perf_counter()
            realised_peak = _peak(groups.device)
            _plain_forward(control)
            _sync(groups.device)
            forward = time.perf_counter() - realised
            row = {"step": realised - start, "jvp": timed.seconds,
                   "realised": realised - trained, "forward": forward}
            if index >= args.warmup:
                rows.append(row)
                if groups.device.type == "cuda":
                    peaks = {**timed.peaks, "merge": merge_peak, "realised_kl": realised_peak}
            print(f"step {index}{' (warm-up)' if index < args.warmup else ''}: "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in row.items()), file=sys.stderr,
                  flush=True)
        medians = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        result: dict[str, Any] = {
            "shape": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "ffn", "vocab",
                                                    "seq_length", "sketch_rank", "dtype")},
            "medians_s": medians,
            "jvp_over_forward": statistics.median(r["jvp"] / r["forward"] for r in rows),
            "realised_over_forward": statistics.median(r["realised"] / r["forward"]
                                                       for r in rows),
            "probe_share_of_step": statistics.median((r["jvp"] + r["realised"]) / r["step"]
                                                     for r in rows),
            "probe_share_at_paper_ratio": statistics.median(
                _share_at_ratio(r, args.microbatches, args.probe_responses) for r in rows),
            "load_average": os.getloadavg(),
        }
        if args.repeats:
            jvps, forwards = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                control(timed.proposal)
                _sync(groups.device)
                jvps.append(time.perf_counter() - start)
                start = time.perf_counter()
                _plain_forward(control)
                _sync(groups.device)
                forwards.append(time.perf_counter() - start)
            result["alternated_s"] = {"jvp": jvps, "forward": forwards}
            result["jvp_over_forward_fastest"] = min(jvps) / min(forwards)
        if groups.device.type == "cuda":
            # The last measured step's peaks; the probe must stay below the backward's.
            result["peak_allocated_bytes"] = peaks
            result["probe_below_backward"] = max(peaks["kl_probe"], peaks["realised_kl"]) < (
                peaks["forward_backward"])
        if args.profile:
            control.set_batch(supervised_probe_batch(batch, probe_settings, dp_rank=0,
                                                     dp_size=1))
            captured: dict[str, Any] = {}

            def capture(proposal: Any) -> float:
                captured["proposal"] = proposal
                return control(proposal)

            setup.logra.step_scale = _Capture(capture, control)
            train_step(setup, batch, groups=groups, seq_length=args.seq_length,
                       micro_batch_size=1)
            control.realised()
            result["profile_jvp"] = _profile(lambda: control(captured["proposal"]))
            result["profile_forward"] = _profile(lambda: _plain_forward(control))
        return result
    finally:
        destroy_parallel()


class _Capture:
    def __init__(self, fn: Any, inner: Any) -> None:
        self.fn, self.inner = fn, inner

    def __call__(self, proposal: Any) -> float:
        return self.fn(proposal)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        print("error: --steps must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    if not 1 <= args.probe_responses <= args.microbatches:
        print(f"error: --probe-responses {args.probe_responses} must be between 1 and "
              f"--microbatches ({args.microbatches})", file=sys.stderr)
        return 2
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    m = result["medians_s"]
    print(f"shape: {result['shape']}")
    print(f"median seconds: step {m['step']:.2f} (jvp {m['jvp']:.2f}, realised "
          f"{m['realised']:.2f}), plain forward of the probe {m['forward']:.2f}")
    print(f"forward-mode pass / plain forward: {result['jvp_over_forward']:.2f} (goal <= 2.5)")
    if "jvp_over_forward_fastest" in result:
        print(f"  the same, fastest of {args.repeats} alternated: "
              f"{result['jvp_over_forward_fastest']:.2f}")
    print(f"realised-KL pass / plain forward: {result['realised_over_forward']:.2f}")
    print(f"probe share of the step ({args.probe_responses} of {args.microbatches} sequences "
          f"probed): {100 * result['probe_share_of_step']:.1f}% (goal <= 25%)")
    print(f"  at the paper's {PAPER_PROBED} of {PAPER_PER_RANK} per rank, from these costs: "
          f"{100 * result['probe_share_at_paper_ratio']:.1f}%")
    print("load average (1, 5, 15 min): " + ", ".join(f"{x:.1f}" for x in result["load_average"]))
    if "peak_allocated_bytes" in result:
        print("peak allocated [MiB]: " + ", ".join(
            f"{k} {v / 2**20:,.1f}" for k, v in result["peak_allocated_bytes"].items()))
    for key in ("profile_jvp", "profile_forward"):
        if key in result:
            print(f"\n{key}:\n{result[key]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
