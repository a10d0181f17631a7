"""LoRA adapters on real Megatron-Core tensor-parallel linears over gloo (the memory baseline).

One torchrun job per layout runs ``workers/lora_worker.py``; each test asserts one claim on what
it measured. Layouts: TP=1; TP=2 (column targets: A replicated, B split by rows; row targets: A
split by input columns, the [T, r] product all-reduced, B replicated); TP=2 with sequence
parallelism (the [T, r] product gathered / reduce-scattered along the sequence, the replicated
adapter with sequence-partial gradients all-reduced by Megatron's finalize_model_grads). The
model has a gated fc1 (interleaved gate/up rows per TP rank) and biases on every linear.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.layouts import (
    LORA_LAYOUT_ADAPTER_REL_TOL,
    LORA_LAYOUT_GRAD_NORM_REL_TOL,
    LORA_LAYOUT_LOSS_REL_TOL,
    WORKER_LAYOUTS,
    run_worker_at,
)
from tests.torchrun import WORKERS, run_torchrun

pytestmark = pytest.mark.distributed

# float64 throughout; the LoRA branch and the merged weight differ only in the order of the
# products (X A^T B^T vs X (B A)^T) and the TP reductions; observed <= 3e-15 relative.
FP64_REL_TOL = 1e-12
# The adapters (B = 0.1 * N(0, 1)) must move the float64 loss far above that tolerance for the
# merged-weight comparison to mean anything; observed 2e-3.
MIN_ADAPTER_LOSS_EFFECT = 1e-4
NUM_TARGETS = 8  # 2 layers x (linear_qkv, linear_proj, linear_fc1, linear_fc2)

LAYOUTS = {name: WORKER_LAYOUTS[name] for name in ("tp1", "tp2", "tp2_sp")}
_runs: dict[str, Path] = {}


def _run(name: str, root: Path) -> Path:
    if name not in _runs:
        out = root / name
        out.mkdir()
        run_worker_at(name, WORKERS / "lora_worker.py", out, "--case", "measure",
                      *(["--save"] if name == "tp2" else []))
        _runs[name] = out
    return _runs[name]


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(params=sorted(LAYOUTS))
def measured(request, runs_root) -> dict:
    return json.loads((_run(request.param, runs_root) / "result.json").read_text())


@pytest.fixture(params=["tp2", "tp2_sp"])
def tp2_and_reference(request, runs_root) -> tuple[Path, Path]:
    return _run(request.param, runs_root), _run("tp1", runs_root)


def _max_rel_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(want)
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)


def test_lora_model_at_initialisation_computes_exactly_the_base_model(measured):
    init = measured["init"]
    assert init["num_adapters"] == NUM_TARGETS
    assert init["losses_bitwise_equal"]
    assert init["logits_bitwise_equal"]


def test_attach_lora_rejects_bad_rank_alpha_and_a_second_attachment(measured):
    rejected = measured["init"]["rejected"]
    assert "lora_rank=0" in rejected["lora_rank"]
    assert "alpha=-1.0" in rejected["alpha"]
    assert "already has a LoRA adapter" in rejected["twice"]


def test_lora_forward_equals_the_base_model_with_merged_weights_in_float64(measured):
    fp64 = measured["fp64"]
    assert fp64["adapter_loss_effect"] > MIN_ADAPTER_LOSS_EFFECT
    assert fp64["loss_rel_err"] < FP64_REL_TOL


def test_adapter_gradients_equal_chain_rule_of_the_merged_weight_gradient_in_float64(measured):
    """dB = scale * G A^T and dA = scale * B^T G, G the dense gradient of W + scale * B A."""
    errors = measured["fp64"]["grad_rel_err"]
    assert errors["a"] < FP64_REL_TOL, errors
    assert errors["b"] < FP64_REL_TOL, errors


def test_adapter_gradients_at_tp2_equal_tp1_in_float64(tp2_and_reference):
    tp2, tp1 = tp2_and_reference
    got, want = torch.load(tp2 / "grads.pt"), torch.load(tp1 / "grads.pt")
    assert len(want) == 2 * NUM_TARGETS
    assert _max_rel_diff(got, want) < FP64_REL_TOL


def test_lora_training_at_tp2_matches_tp1_losses_grad_norms_and_adapters(tp2_and_reference):
    tp2, tp1 = tp2_and_reference
    got = json.loads((tp2 / "result.json").read_text())["train"]
    want = json.loads((tp1 / "result.json").read_text())["train"]
    for g, w in zip(got["losses"], want["losses"], strict=True):
        assert abs(g - w) <= LORA_LAYOUT_LOSS_REL_TOL * abs(w), (got["losses"], want["losses"])
    for g, w in zip(got["grad_norms"], want["grad_norms"], strict=True):
        assert abs(g - w) <= LORA_LAYOUT_GRAD_NORM_REL_TOL * abs(w), (
            got["grad_norms"], want["grad_norms"])
    adapters = torch.load(tp1 / "adapters.pt")
    assert _max_rel_diff(torch.load(tp2 / "adapters.pt"), adapters) < LORA_LAYOUT_ADAPTER_REL_TOL


def test_lora_training_moves_only_the_adapters(measured):
    train = measured["train"]
    assert train["b_abs_max_after"] > 0.0  # every B left zero: the adapters were trained
    assert train["num_base_params"] > 0
    assert train["base_unchanged"]
    assert train["trainable_are_adapters"]
    assert not train["base_any_requires_grad"]
    assert not train["base_any_grad"]
    assert not train["base_any_main_grad"]


def test_lora_checkpoint_saved_at_tp2_loads_at_tp1_with_identical_adapters(runs_root):
    """The loading run initialises its adapters from another seed (and B = 0), so equality
    means both A and B came from the checkpoint, resharded from TP=2 (incl. fc1's gate/up rows)."""
    saved = _run("tp2", runs_root)
    (checkpoint,) = sorted((saved / "ckpt").glob("iter_*"))
    out = runs_root / "tp1_load"
    out.mkdir()
    run_torchrun(1, [str(WORKERS / "lora_worker.py"), "--case", "load", "--tp", "1",
                     "--out", str(out), "--checkpoint", str(checkpoint)])
    loaded, trained = torch.load(out / "loaded.pt"), torch.load(saved / "adapters.pt")
    assert sorted(loaded) == sorted(trained)
    for key, value in trained.items():
        assert torch.equal(loaded[key], value), key
