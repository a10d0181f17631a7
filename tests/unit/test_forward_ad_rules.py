"""The forward-mode rules on Megatron-Core's Functions do only the tangent's own work.

A frozen linear's tangent along its input is ``dX W^T``: one matmul beside the primal's. torch
hands a custom Function's ``jvp`` zeros for every input without a tangent unless told not to,
and a linear's rule would then multiply the input by a zero weight tangent as well -- a second,
wasted matmul as large as the primal's (a third of a probe pass's matmul time, measured).
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_logra.mcore.compat.forward_ad import install_forward_ad_rules

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


def test_frozen_linear_with_an_input_tangent_runs_one_tangent_matmul_and_it_is_exact():
    install_forward_ad_rules()
    generator = torch.Generator().manual_seed(0)
    x, dx = (torch.randn(6, 1, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    weight = torch.randn(5, 8, generator=generator, dtype=torch.float64)
    counter = _CountMatmuls()
    with torch.no_grad(), fwAD.dual_level(), counter:
        out = LinearWithFrozenWeight.apply(fwAD.make_dual(x, dx), weight, None, False, None)
        primal, tangent = fwAD.unpack_dual(out)
    assert counter.count == 2  # the primal X W^T and the tangent dX W^T, nothing else
    assert torch.equal(primal, x @ weight.t())
    assert torch.equal(tangent, dx @ weight.t())
