"""The live-tensor tracker against hand-computed byte counts (fp32: 4 bytes an element)."""

from __future__ import annotations

import pytest
import torch

from megatron_logra.memory.live_tensors import ACTIVATIONS, TEMPORARIES, LiveTensorTracker

F32 = 4
N = 1000


def test_a_tensor_counts_its_storage_bytes_while_alive_and_nothing_after_it_is_freed():
    with LiveTensorTracker() as tracker:
        a = torch.empty(N)
        assert tracker.live_bytes == N * F32
        del a
        assert tracker.live_bytes == 0
    assert tracker.peak_bytes == N * F32


def test_views_and_in_place_ops_add_no_bytes():
    with LiveTensorTracker() as tracker:
        a = torch.zeros(16, 16)
        v = a.view(256)
        a.add_(1.0)
        v[3:7].mul_(2.0)
        _ = a.t()
        assert tracker.live_bytes == 256 * F32
    assert tracker.peak_bytes == 256 * F32


def test_a_storage_is_freed_only_when_its_last_view_dies():
    with LiveTensorTracker() as tracker:
        a = torch.zeros(N)
        view = a[10:20]
        del a
        assert tracker.live_bytes == N * F32
        del view
        assert tracker.live_bytes == 0


def test_peak_is_the_largest_live_total_with_its_categories_at_that_moment():
    with LiveTensorTracker() as tracker:
        a = torch.empty(N)          # 4000 live
        b = torch.empty(2 * N)      # 12000 live: the peak
        del a                       # 8000
        c = torch.empty(N // 2)     # 10000
        report = tracker.report()
    assert report.live_bytes == (2 * N + N // 2) * F32
    assert report.peak_bytes == 3 * N * F32
    assert report.peak_by_category == {TEMPORARIES: 3 * N * F32}
    assert (b.numel(), c.numel()) == (2 * N, N // 2)


def test_an_op_output_is_counted_while_its_inputs_are_alive():
    a = torch.ones(N)
    with LiveTensorTracker() as tracker:
        tracker.label([a], "inputs")
        b = a * 2.0                  # a and b both alive when the op returns
        del a
    assert tracker.peak_bytes == 2 * N * F32
    assert tracker.live_bytes == N * F32
    assert b.numel() == N


def test_in_place_resize_is_remeasured():
    with LiveTensorTracker() as tracker:
        a = torch.empty(10)
        a.resize_(N)
        assert tracker.live_bytes == N * F32


def test_label_counts_a_storage_made_before_tracking_once_and_moves_categories():
    w = torch.empty(10, 10)
    with LiveTensorTracker() as tracker:
        assert tracker.label([w, w.view(100), None], "weights") == 100 * F32
        t = torch.empty(N)
        assert tracker.report().live_by_category == {"weights": 100 * F32,
                                                     TEMPORARIES: N * F32}
        assert tracker.label([t], "grads") == N * F32
        assert tracker.report().live_by_category == {"weights": 100 * F32, "grads": N * F32}
        del w
        assert tracker.live_bytes == N * F32
    assert t.numel() == N


def test_label_live_moves_every_temporary_and_only_temporaries():
    with LiveTensorTracker() as tracker:
        a, b = torch.empty(N), torch.empty(N)
        tracker.label([a], "weights")
        assert tracker.label_live("persistent") == N * F32
        assert tracker.report().live_by_category == {"weights": N * F32,
                                                     "persistent": N * F32}
    assert b.numel() == N


def test_tensors_saved_for_backward_are_activations_until_backward_frees_them():
    x = torch.randn(N, requires_grad=True)
    with LiveTensorTracker() as tracker:
        tracker.label([x], "weights")
        y = x.exp()                  # exp saves its output y: an activation
        z = y.sum()                  # sum saves nothing; z is a 4-byte temporary
        del y
        before = tracker.report()
        tracker.reset_peak()
        z.backward()                 # frees y; x.grad = exp(x) * dz survives
        after = tracker.report()
    assert before.live_by_category == {"weights": N * F32, ACTIVATIONS: N * F32, TEMPORARIES: F32}
    # Backward: ones_like(z) (4 bytes), then dz * y (N floats) while y is still saved.
    assert after.peak_bytes == before.live_bytes + F32 + N * F32
    assert after.peak_by_category[ACTIVATIONS] == N * F32
    assert after.live_by_category == {"weights": N * F32, TEMPORARIES: F32 + N * F32}
    assert torch.allclose(x.grad, x.detach().exp())


def test_a_linear_layer_saves_its_input_as_the_only_activation():
    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64, requires_grad=True)
    with LiveTensorTracker() as tracker:
        tracker.label(list(layer.parameters()), "weights")
        h = x * 1.0                  # a fresh [8, 64] tensor, saved by the matmul
        out = layer(h)
        report = tracker.report()
    assert report.live_by_category == {"weights": 64 * 32 * F32, ACTIVATIONS: 8 * 64 * F32,
                                       TEMPORARIES: 8 * 32 * F32}
    assert out.shape == (8, 32)


def test_frees_after_the_block_still_count_but_new_allocations_do_not():
    with LiveTensorTracker() as tracker:
        a = torch.empty(N)
    b = torch.empty(N)
    assert tracker.live_bytes == N * F32
    del a
    assert tracker.live_bytes == 0
    assert b.numel() == N


def test_bad_labels_raise_value_error_naming_the_problem():
    tracker = LiveTensorTracker()
    with pytest.raises(ValueError, match="category is empty"):
        tracker.label([torch.empty(1)], "")
    with pytest.raises(ValueError, match="strided"):
        tracker.label([torch.empty(2, 2).to_sparse()], "weights")
    with pytest.raises(ValueError, match="category is empty"):
        tracker.label_live("")


def test_a_span_measures_its_own_peak_and_the_tracker_keeps_the_overall_one():
    with LiveTensorTracker() as tracker:
        big = torch.zeros(1000, dtype=torch.float32)  # 4000 B, freed before the span
        del big
        kept = torch.zeros(100, dtype=torch.float32)  # 400 B alive through the span
        with tracker.span() as span:
            small = torch.zeros(200, dtype=torch.float32)  # 800 B
            del small
        assert span.peak_bytes == 400 + 800
        assert tracker.peak_bytes == 4000
        with tracker.span() as larger:
            huge = torch.zeros(2000, dtype=torch.float32)  # 8000 B
            del huge
        assert larger.peak_bytes == tracker.peak_bytes == 400 + 8000
        del kept
