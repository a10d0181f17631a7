"""The paper's RowAdam direction and update-ratio normalisation against float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.row_adam_paper import PaperRowAdamLayer, paper_row_adam_, update_ratio_scale

BETA2, EPS = 0.95, 1e-8
# float64 throughout; the implementation sums in float64 too. Only reordering differs.
FP64_REL_TOL = 1e-12


def _reference(sketch: torch.Tensor, moment: torch.Tensor, step: int) -> tuple[torch.Tensor,
                                                                             torch.Tensor]:
    """The five steps of the paper's rule, written out for one layer held entirely."""
    moment = BETA2 * moment + (1 - BETA2) * sketch.pow(2).mean(dim=1)
    rho = torch.sqrt(moment / (1 - BETA2**step))
    d = rho + max(EPS * float(rho.mean()), torch.finfo(torch.float32).tiny)
    c = d.min() / d
    c = c / torch.sqrt((c**2).mean())
    direction = c[:, None] * sketch
    direction = direction * sketch.norm() / direction.norm()
    return direction, moment


def test_paper_row_adam_equals_the_written_out_rule_over_three_steps():
    generator = torch.Generator().manual_seed(0)
    moments = [torch.zeros(6, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)]
    reference_moments = [m.clone() for m in moments]
    for step in (1, 2, 3):
        sketches = [torch.randn(6, 4, generator=generator, dtype=torch.float64) * 10.0**step,
                    torch.randn(3, 5, generator=generator, dtype=torch.float64)]
        expected = []
        for index, sketch in enumerate(sketches):
            direction, reference_moments[index] = _reference(sketch, reference_moments[index],
                                                             step)
            expected.append(direction)
        layers = [PaperRowAdamLayer(s, m, None) for s, m in zip(sketches, moments, strict=True)]
        paper_row_adam_(layers, step=step, beta2=BETA2, eps=EPS)
        for got, want in zip(sketches, expected, strict=True):
            assert torch.allclose(got, want, rtol=FP64_REL_TOL, atol=0.0)
        for got, want in zip(moments, reference_moments, strict=True):
            assert torch.allclose(got, want, rtol=FP64_REL_TOL, atol=0.0)


def test_each_layer_keeps_its_sketch_norm_and_row_scales_are_rms_normalised():
    sketch = torch.tensor([[3.0, 4.0], [0.3, 0.4], [30.0, 40.0]], dtype=torch.float64)
    norm = float(sketch.norm())
    layer = PaperRowAdamLayer(sketch, torch.zeros(3, dtype=torch.float64), None)
    paper_row_adam_([layer], step=1, beta2=BETA2, eps=0.0)
    assert float(sketch.norm()) == pytest.approx(norm, rel=FP64_REL_TOL)
    # At step 1 with eps=0 every row is normalised to the same RMS (scale invariance per row).
    rms = sketch.pow(2).mean(dim=1).sqrt()
    assert torch.allclose(rms, rms[0].expand(3), rtol=FP64_REL_TOL)


def test_all_zero_sketch_gives_a_zero_direction():
    sketch = torch.zeros(4, 3, dtype=torch.float64)
    paper_row_adam_([PaperRowAdamLayer(sketch, torch.zeros(4, dtype=torch.float64), None)],
                    step=1, beta2=BETA2, eps=EPS)
    assert bool((sketch == 0).all())


def test_update_ratio_scale_sizes_the_update_to_the_ratio_of_the_weights():
    weight_sq, direction_sq, ratio = 16.0, 9.0, 6e-5
    kappa = update_ratio_scale(weight_sq, direction_sq, ratio)
    assert kappa * math.sqrt(direction_sq) == pytest.approx(ratio * math.sqrt(weight_sq))
    assert update_ratio_scale(weight_sq, 0.0, ratio) == 0.0
    with pytest.raises(RuntimeError, match="non-finite or negative"):
        update_ratio_scale(float("nan"), 1.0, ratio)
