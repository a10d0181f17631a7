"""The finiteness flags a step is refused on (single process; the agreement over ranks is
tested in tests/distributed/test_poisoned_update.py)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.finite_check import agreed_flags, local_finite


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_local_finite_is_false_for_any_non_finite_tensor_entry_or_scalar(bad):
    good = torch.ones(3, 4)
    poisoned = good.clone()
    poisoned[2, 1] = bad
    assert local_finite([good], [1.0, 0.0])
    assert not local_finite([good, poisoned])
    assert not local_finite([good], [bad])


def test_agreed_flags_without_process_groups_returns_the_local_flags_by_name():
    flags = {"alpha": True, "factor": False}
    assert agreed_flags(flags, (None,), torch.device("cpu")) == flags
