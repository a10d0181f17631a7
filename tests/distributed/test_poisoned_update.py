"""No non-finite value reaches a weight (issue 15 item 2), on real Megatron-Core over gloo.

One torchrun job of two processes (TP=2) runs ``workers/poisoned_update_worker.py``: a NaN put
at each stage of a step -- sketch, direction, update-ratio factor, step scale alpha, merged
factor U, a native gradient (library mode), reward, loss -- on one rank only for the optimizer
stages. Two processes, because the claim is that the *other* rank refuses as well. The tests:

* every rank raises, naming the stage, and saying that no weight was changed;
* every parameter and the row moments are bit-identical to before, the update count unchanged;
* a clean step afterwards succeeds and moves the weights.
"""

from __future__ import annotations

import json

import pytest

from tests.torchrun import WORKERS, run_torchrun

pytestmark = pytest.mark.distributed

# What each refusal must say (a fragment of the message), per stage.
STAGE_MESSAGES = {
    "sketch": "non-finite LoGRA sketch",
    "direction": "non-finite LoGRA direction",
    "ratio": "non-finite LoGRA update-ratio factor",
    "alpha": "non-finite LoGRA step scale",
    "factor": "non-finite LoGRA update factor U",
    "native_grad": "non-finite gradient norm",
    "reward": "non-finite reward",
    "loss": "non-finite policy loss",
}
OPTIMIZER_STAGES = {
    "paper": ("sketch", "direction", "ratio", "alpha", "factor"),
    "library": ("sketch", "direction", "alpha", "factor", "native_grad"),
}


@pytest.fixture(scope="module")
def report(tmp_path_factory, synthetic_data_dir) -> dict:
    out = tmp_path_factory.mktemp("poisoned_update")
    run_torchrun(2, [str(WORKERS / "poisoned_update_worker.py"), "--data",
                     str(synthetic_data_dir), "--out", str(out)])
    return json.loads((out / "result.json").read_text())


def _stages(report: dict):
    for mode, stages in OPTIMIZER_STAGES.items():
        for stage in stages:
            yield f"{mode}/{stage}", stage, report[mode][stage]
    for stage in ("reward", "loss"):
        yield f"rl/{stage}", stage, report["rl"][stage]


def test_nan_at_every_stage_raises_on_every_rank_naming_the_stage(report):
    for where, stage, result in _stages(report):
        for rank, error in enumerate(result["errors"]):
            assert error is not None, f"{where}: rank {rank} did not refuse"
            assert STAGE_MESSAGES[stage] in error, (where, rank, error)
            assert "no weight" in error and "was changed" in error, (where, rank, error)


def test_nan_at_every_stage_leaves_weights_and_row_moments_bit_identical(report):
    for where, _, result in _stages(report):
        assert result["unchanged"], where
        assert result["update_count"] == 0, where


def test_a_clean_step_after_the_refusals_moves_the_weights(report):
    for mode in OPTIMIZER_STAGES:
        assert report[mode]["clean_step"] == {"unchanged": False, "update_count": 1}, mode
