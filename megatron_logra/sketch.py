"""The sketch math of LoGRA, on plain tensors.

For a linear layer ``Y = X W^T`` with ``W [m, n]``, output gradient ``H = dL/dY [T, m]`` and
input ``X [T, n]``, the dense weight gradient is ``G = H^T X [m, n]``. LoGRA never forms ``G``:
the forward pass keeps the projected input ``P = X A^T [T, r]`` and the backward pass adds
``H^T P = G A^T [m, r]`` into an fp32 sketch. The update ``-lr * D A`` is merged into ``W`` later.

Shape suffixes: T = tokens, O = output rows (m), I = input columns (n), R = sketch rank (r).
"""

from __future__ import annotations

import torch


def project_activations(input_TI: torch.Tensor, proj_RI: torch.Tensor) -> torch.Tensor:
    """``P = X A^T``: the only activation a sketched layer keeps for its weight gradient."""
    return torch.matmul(input_TI, proj_RI.t())


def accumulate_sketch_(
    sketch_OR: torch.Tensor, grad_output_TO: torch.Tensor, projected_TR: torch.Tensor
) -> None:
    """``S += H^T P`` in the sketch's dtype (fp32, or fp64 for reference computations).

    A bf16 product would round every microbatch's contribution to 8 bits of mantissa before it
    is summed; the sketch is the only gradient signal of the layer, so it is accumulated in at
    least fp32 whatever the activation dtype.
    """
    if sketch_OR.dtype not in (torch.float32, torch.float64):
        raise RuntimeError(f"sketches are accumulated in float32 or float64, got {sketch_OR.dtype}")
    sketch_OR.addmm_(grad_output_TO.to(sketch_OR.dtype).t(), projected_TR.to(sketch_OR.dtype))


def reconstructed_sq_norm(sketch_OR: torch.Tensor, proj_RI: torch.Tensor) -> torch.Tensor:
    """``||S A||_F^2`` through the r x r Gram matrix, never by reconstruction.

    ``||S A||^2 = tr(S A A^T S^T) = <S (A A^T), S>``. With ``A = I`` this is ``||G||^2``, the
    dense gradient norm. Returned as a float64 scalar: it is summed over many layers and ranks.
    """
    proj = proj_RI.to(sketch_OR.dtype)
    gram_RR = torch.matmul(proj, proj.t())
    return (torch.matmul(sketch_OR, gram_RR).double() * sketch_OR.double()).sum()


def apply_low_rank_update_(
    weight_OI: torch.Tensor,
    direction_OR: torch.Tensor,
    proj_RI: torch.Tensor,
    *,
    lr: float,
    weight_decay: float = 0.0,
) -> None:
    """``W <- (1 - lr * wd) W - lr * D A`` in place (decoupled weight decay, as AdamW).

    The weight must be fp32: a per-step relative change of ~1e-4 is below bf16 resolution and
    would be rounded away (callers with bf16 parameters pass their fp32 master instead).
    """
    if weight_OI.dtype != torch.float32:
        raise RuntimeError(
            f"LoGRA merges updates into float32 weights or masters, got {weight_OI.dtype}"
        )
    if weight_decay != 0.0:
        weight_OI.mul_(1.0 - lr * weight_decay)
    weight_OI.addmm_(direction_OR.float(), proj_RI.float(), alpha=-lr)
