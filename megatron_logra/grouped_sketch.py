"""Per-expert LoGRA sketches of grouped-GEMM experts, on plain tensors.

Grouped-GEMM experts (Megatron's ``TEGroupedMLP`` on GPU) run every local expert of a layer in one
call over the tokens sorted by expert, split by ``tokens_per_expert``. The per-expert sketch
``S_e = H_e^T (X_e A_e^T)`` of ``megatron_logra.sketch`` then becomes two grouped calls instead of
a loop over experts (docs/moe.md, "Grouped-GEMM experts"):

1. ``P = [X_e A_e^T]_e [T, r]``: the tokens against the experts' stacked projections ``[E, r, n]``,
   split along the tokens (what the forward keeps instead of ``X [T, n]``);
2. ``S = [H_e^T P_e]_e [E, m, r]``: split along the tokens as the reduction dimension, one
   ``[m, r]`` sketch per expert, laid out as the flat buffer's expert region would hold them.

An expert without tokens gets an exactly zero sketch from both (an empty reduction), which is what
the optimizer's idle-expert rule reads. ``torch._grouped_mm`` does the grouping (CPU: fp32/bf16,
CUDA: bf16 on Hopper); ``loop_sketches`` is the per-expert reference the CPU path computes today.

Shape suffixes: T = routed tokens (sorted by expert), E = experts, O = output rows (m),
I = input columns (n), R = sketch rank (r).
"""

from __future__ import annotations

import torch

from megatron_logra.sketch import accumulate_sketch_, project_activations


def _grouped_mm():
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm: grouped expert "
                           "sketches need torch >= 2.8; use the per-expert loop (loop_sketches)")
    return grouped


def expert_offsets(tokens_per_expert: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Each expert's end row in the sorted tokens (int32, as the grouped GEMM takes them)."""
    counts = torch.as_tensor(tokens_per_expert)
    if counts.dim() != 1 or bool((counts < 0).any()):
        raise ValueError(f"tokens_per_expert must be a vector of counts >= 0, got {counts.tolist()}")
    return torch.cumsum(counts, 0).to(device=device, dtype=torch.int32)


def grouped_projected_inputs(input_TI: torch.Tensor, proj_ERI: torch.Tensor,
                             tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``P_e = X_e A_e^T`` for every expert in one call: ``[T, r]``."""
    offsets = expert_offsets(tokens_per_expert, input_TI.device)
    if int(offsets[-1]) != input_TI.shape[0]:
        raise ValueError(f"tokens_per_expert sums to {int(offsets[-1])}, the input has "
                         f"{input_TI.shape[0]} rows")
    return _grouped_mm()(input_TI, proj_ERI.transpose(1, 2), offs=offsets)


def grouped_sketches(grad_output_TO: torch.Tensor, projected_TR: torch.Tensor,
                     tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``S_e = H_e^T P_e`` for every expert in one call: ``[E, m, r]`` in the inputs' dtype (the
    caller accumulates it into the fp32 sketch; on GPU that output must be fp32, see the GPU
    check's ``moe_grouped_sketch``)."""
    offsets = expert_offsets(tokens_per_expert, grad_output_TO.device)
    return _grouped_mm()(grad_output_TO.t(), projected_TR, offs=offsets)


def loop_sketches(input_TI: torch.Tensor, grad_output_TO: torch.Tensor, proj_ERI: torch.Tensor,
                  tokens_per_expert: torch.Tensor, dtype: torch.dtype = torch.float32
                  ) -> torch.Tensor:
    """The reference: one expert at a time, as ``SequentialMLP``'s sketched linears do."""
    experts, rank = proj_ERI.shape[0], proj_ERI.shape[1]
    out = torch.zeros(experts, grad_output_TO.shape[1], rank, dtype=dtype,
                      device=input_TI.device)
    start = 0
    for e, count in enumerate(torch.as_tensor(tokens_per_expert).tolist()):
        rows = slice(start, start + count)
        projected = project_activations(input_TI[rows].to(dtype), proj_ERI[e].to(dtype))
        accumulate_sketch_(out[e], grad_output_TO[rows], projected)
        start += count
    return out
