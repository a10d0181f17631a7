"""``rl.updates_per_rollout`` through a real RL step (issue 15 item 5), one torchrun process.

``workers/policy_updates_worker.py`` runs one GRPO step with one and with two updates per
rollout batch (fixed nonzero advantages: a random model's rewards all tie). One process: the
claim is about the loss's ratio, which is layout independent (the loss is tested per layout
elsewhere).
"""

from __future__ import annotations

import json

import pytest

from tests.torchrun import WORKERS, run_torchrun

pytestmark = pytest.mark.distributed

# A clip this tight binds on the second update: the first moves a token's log-prob by ~0.1
# (the demo's per-token KL budget, 5e-3), far outside exp(+-0.01).
TIGHT_CLIP = 0.01


@pytest.fixture(scope="module")
def report(tmp_path_factory, synthetic_data_dir) -> dict:
    out = tmp_path_factory.mktemp("policy_updates")
    run_torchrun(1, [str(WORKERS / "policy_updates_worker.py"), "--data", str(synthetic_data_dir),
                     "--out", str(out), "--clip", str(TIGHT_CLIP)])
    return json.loads((out / "result.json").read_text())


def test_one_update_per_rollout_is_on_policy_and_clips_nothing(report):
    one = report["updates_1"]
    assert one["ratio_mean"] == 1.0 and one["clip_fraction"] == 0.0
    assert one["update_count"] == 1


def test_two_updates_per_rollout_take_two_steps_and_the_clip_binds_off_policy(report):
    two = report["updates_2"]
    assert two["update_count"] == 2
    # The second update's ratio is against the trainer's log-probs before the first.
    assert two["clip_fraction"] > 0.0
    assert two["ratio_mean"] != 1.0
