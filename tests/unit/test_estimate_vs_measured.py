"""The memory estimator against the measured peak live tensors of the model the product builds.

One run of tools/estimate_vs_measured.py (one process, CPU) on a small GPT whose step is
dominated by what the estimator models beyond the persistent state (activations are ~2/3 of the
peak): every method, per recompute mode, with ``sdpa`` and ``local`` attention, fp32 and bf16;
and a packed microbatch (train.packing: two sequences in one row) on part of that grid.
A term dropped from either side -- the estimator's or the model's -- moves some configuration
past the tolerance.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.torchrun import REPO, torchrun_env

TOLERANCE = 0.10
"""The issue's claim for the estimator: |estimate / measured peak - 1| <= 10%."""
# Width 64 (head width 16) at 256 tokens: the s x s terms of local attention and the vocabulary
# terms both matter, and each measured step takes well under a second.
MODEL = ["--layers", "2", "--hidden", "64", "--ffn", "128", "--heads", "4", "--vocab", "128",
         "--rank", "8", "--seq-lengths", "256"]
CONFIGS = (
    "fp32:sdpa:none", "fp32:sdpa:selective", "fp32:sdpa:full",
    "fp32:local:none", "fp32:local:selective", "fp32:local:full",
    "bf16:sdpa:none", "bf16:sdpa:full", "bf16:local:none", "bf16:local:selective",
    "bf16:local:full",
)
# logra_kl: library mode under KL control (its realised KL keeps a copy of the trained output
# weight).
METHODS = ("dense_adam", "lora", "logra", "logra_paper", "logra_kl")
KL_METHODS = ("logra_paper", "logra_kl")
# The tracker cannot follow the KL probe through local attention (the tool says why).
CASES = [(config, method) for config in CONFIGS for method in METHODS
         if not (":local:" in config and method in KL_METHODS)]
KL_CASES = [(config, method) for config, method in CASES if method in KL_METHODS]


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, str], dict]:
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(REPO / "tools" / "estimate_vs_measured.py"),
         *MODEL, "--configs", ",".join(CONFIGS), "--methods", ",".join(METHODS), "--json"],
        env=torchrun_env(), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    measured = json.loads(done.stdout)
    return {(f"{r['dtype']}:{r['attention']}:{r['recompute']}", r["method"]): r
            for r in measured}


# Packed rows (train.packing on prompt data): each step one row of the same 256 tokens holding
# two sequences of 128, attention within each (local attention's s x s terms per sequence).
PACKED_SEQUENCES = 2
PACKED_CONFIGS = ("fp32:sdpa:none", "fp32:local:selective", "bf16:local:full")
PACKED_METHODS = ("dense_adam", "logra", "logra_paper")
PACKED_CASES = [(config, method) for config in PACKED_CONFIGS for method in PACKED_METHODS
                if not (":local:" in config and method == "logra_paper")]


@pytest.fixture(scope="module")
def packed_rows() -> dict[tuple[str, str], dict]:
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(REPO / "tools" / "estimate_vs_measured.py"),
         *MODEL, "--packed", str(PACKED_SEQUENCES), "--configs", ",".join(PACKED_CONFIGS),
         "--methods", ",".join(PACKED_METHODS), "--json"],
        env=torchrun_env(), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {(f"{r['dtype']}:{r['attention']}:{r['recompute']}", r["method"]): r
            for r in json.loads(done.stdout)}


@pytest.mark.parametrize(("config", "method"), PACKED_CASES)
def test_estimate_of_a_packed_microbatch_is_within_ten_percent_of_the_measured_peak(
        packed_rows, config, method):
    row = packed_rows[(config, method)]
    assert row["packed"] == PACKED_SEQUENCES
    measured, estimate = row["measured"]["peak_bytes"], row["estimate"]["total_bytes"]
    assert abs(estimate / measured - 1) <= TOLERANCE, (config, method, measured, estimate)


def test_every_configuration_of_the_grid_was_measured(rows):
    assert sorted(rows) == sorted(CASES)


@pytest.mark.parametrize(("config", "method"), CASES)
def test_estimate_is_within_ten_percent_of_the_measured_peak(rows, config, method):
    row = rows[(config, method)]
    measured, estimate = row["measured"]["peak_bytes"], row["estimate"]["total_bytes"]
    assert abs(estimate / measured - 1) <= TOLERANCE, (config, method, measured, estimate)


@pytest.mark.parametrize(("config", "method"), KL_CASES)
def test_kl_probe_passes_are_estimated_within_ten_percent(rows, config, method):
    """The step control's two passes on their own (the most they hold beyond the persistent
    state: proposal, one piece's pass or output chunk, the kept hidden states -- and in
    library mode the output weight's copy) against the estimate's after-backward phase."""
    row = rows[(config, method)]
    measured = row["measured"]["kl_probe_bytes"]
    assert measured > 0
    assert abs(row["estimate"]["after_backward_bytes"] / measured - 1) <= TOLERANCE, row
