"""Context-parallel settings against the rest of the run: what ``parallel.cp`` needs, and which
combinations are refused (and why).

The keys live in the ``parallel`` section (``parallel.cp``, ``parallel.cp_comm_type``); this
module checks them against the model and the optimizer (:func:`check_cp_run`). docs/context_parallel.md
has the design.
"""

from __future__ import annotations

from typing import Any


def cp_sequence_multiple(parallel: Any) -> int:
    """What a sequence length must be a multiple of under ``parallel``: ``2 * cp`` chunks (the
    load-balanced causal split), each of whose halves is split again over TP under sequence
    parallelism."""
    return 2 * parallel.cp * (parallel.tp if parallel.sp else 1) if parallel.cp > 1 else 1


def check_cp_run(cfg: Any) -> None:
    """``parallel.cp`` against the model and optimizer sections (``cfg``: a root Config)."""
    m, p = cfg.model, cfg.parallel
    if p.cp_comm_type is not None and (p.cp == 1 or m.attention != "te"):
        raise ValueError(
            f"parallel.cp_comm_type={p.cp_comm_type} chooses Transformer Engine's "
            f"context-parallel attention; it acts only with parallel.cp > 1 and "
            f"model.attention=te (here cp={p.cp}, attention={m.attention}); drop it (the sdpa "
            "attention always all-gathers keys and values)"
        )
    if p.cp == 1:
        return
    if m.attention == "local":
        raise ValueError(
            f"parallel.cp={p.cp} with model.attention=local: Megatron's DotProductAttention "
            "refuses context parallelism; use model.attention=sdpa (exact all-gather attention, "
            "CPU and GPU) or te (Transformer Engine's, GPU)"
        )
    if m.num_moe_experts is not None:
        raise ValueError(
            f"parallel.cp={p.cp} with an MoE model (model.num_moe_experts="
            f"{m.num_moe_experts}): context parallelism is built and tested for dense models "
            "only; use parallel.cp=1"
        )
    multiple = cp_sequence_multiple(p)
    if m.seq_length % multiple:
        sp = f" x tp {p.tp} (sequence parallelism)" if p.sp else ""
        raise ValueError(
            f"model.seq_length={m.seq_length} must be a multiple of {multiple} = 2 x cp "
            f"{p.cp}{sp}: each sequence is split into 2 * cp equal chunks; change "
            "model.seq_length or parallel.cp"
        )
