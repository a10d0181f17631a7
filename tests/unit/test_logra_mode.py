"""The two LoGRA modes as strategy objects: each method does what its mode's rule says
(DESIGN section 2), checked against the formulas directly."""

from __future__ import annotations

import math

import torch

from megatron_logra.config import LoGRAConfig
from megatron_logra.logra_mode import LibraryMode, PaperMode, logra_mode
from megatron_logra.row_adam_paper import update_ratio_scale


def test_logra_mode_builds_the_mode_named_by_the_config():
    assert isinstance(logra_mode(LoGRAConfig(mode="library")), LibraryMode)
    paper = logra_mode(LoGRAConfig(mode="paper", update_ratio=1e-3))
    assert isinstance(paper, PaperMode) and paper.update_ratio == 1e-3


def test_each_mode_resolves_auto_to_its_own_direction_and_keeps_an_explicit_one():
    assert LibraryMode().direction("auto") == "row_adam"
    paper = PaperMode(update_ratio=1e-3, update_factor_dtype="bf16")
    assert paper.direction("auto") == "paper_row_adam"
    assert paper.direction("sgd") == "sgd"


def test_library_mode_merges_with_the_scheduler_lr_decay_and_scale():
    mode = LibraryMode()
    assert mode.step_size(3e-4, 0.1) == (3e-4, 0.1)
    assert mode.proposal_scale(lambda: 1.0, lambda: 1.0) is None
    direction = torch.randn(4, 3)
    factor, step_lr = mode.merge_factor(direction, 0.5, 3e-4)
    assert factor is direction and step_lr == 0.5 * 3e-4
    assert mode.trains_non_targets and mode.clips_gradients
    norm = mode.grad_norm(native_norm=lambda: 3.0, reconstructed_sq_norm=lambda: 16.0,
                          sketch_frobenius_sq=lambda: 1e9)
    assert norm == 5.0


def test_paper_mode_has_no_lr_no_decay_and_sizes_the_proposal_by_the_update_ratio():
    mode = PaperMode(update_ratio=6e-5, update_factor_dtype="bf16")
    assert mode.step_size(3e-4, 0.1) == (1.0, 0.0)
    assert mode.proposal_scale(lambda: 2.0, lambda: 0.5) == update_ratio_scale(2.0, 0.5, 6e-5)
    assert not mode.trains_non_targets and not mode.clips_gradients
    norm = mode.grad_norm(native_norm=lambda: 1e9, reconstructed_sq_norm=lambda: 1e9,
                          sketch_frobenius_sq=lambda: 9.0)
    assert norm == 3.0 and math.isfinite(norm)


def test_paper_mode_rounds_the_scaled_factor_to_bf16_or_keeps_fp32():
    direction = torch.randn(8, 4, dtype=torch.float32)
    rounded, step_lr = PaperMode(update_ratio=1e-3, update_factor_dtype="bf16").merge_factor(
        direction, 1.7, 1.0)
    assert step_lr == 1.0
    assert torch.equal(rounded, (direction * 1.7).to(torch.bfloat16).float())
    kept, step_lr = PaperMode(update_ratio=1e-3, update_factor_dtype="fp32").merge_factor(
        direction, 1.7, 1.0)
    assert kept is direction and step_lr == 1.7


def test_the_metrics_say_paper_mode_has_no_learning_rate():
    assert LibraryMode().step_metrics(1e-3) == {"lr": 1e-3}
    assert PaperMode(update_ratio=2e-3, update_factor_dtype="bf16").step_metrics(1e-3) == {
        "lr": None, "update_ratio": 2e-3}
