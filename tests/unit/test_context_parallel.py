"""Context parallelism's single-process parts: the sequence split, the bottom-right causal
attention of a CP chunk (forward, backward, tangent rule), the probe's share, the config.

The multi-process claims (CP=2 == CP=1 on real Megatron models) are in
tests/distributed/test_context_parallel.py and the whole-run suites.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from megatron_logra.config import load_config
from megatron_logra.context_parallel import (
    held_chunks,
    held_positions,
    split_batch,
    split_sequence,
    to_global_order,
    to_rank_major_order,
)
from megatron_logra.mcore.models import sdpa_forward_ad
from megatron_logra.mcore.models.sdpa_forward_ad import attention
from megatron_logra.probe_batch import ProbeBatch, context_parallel_share

# float64: the fused kernel (or the tangent rule) and the plain-ops reference differ only in
# summation order (the siblings in test_sdpa_tangent.py measured <= 3.7e-16).
ATTENTION_REL_TOL_FP64 = 1e-12
BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 8


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).detach().abs().max() / want.detach().abs().max())


# ----------------------------------------------------------------------------- the split


def test_rank_r_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert [held_chunks(r, 2) for r in range(2)] == [(0, 3), (1, 2)]
    assert held_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert held_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    held = torch.cat([held_positions(24, r, 3) for r in range(3)])
    assert sorted(held.tolist()) == list(range(24))  # every position on exactly one rank


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_rank_major_concatenation_reorders_to_the_sequence_and_back(cp):
    sequence = torch.arange(2 * 16 * cp).view(2, 16 * cp)
    rank_major = torch.cat([split_sequence(sequence, r, cp) for r in range(cp)], dim=1)
    assert torch.equal(to_global_order(rank_major, cp, dim=1), sequence)
    assert torch.equal(to_rank_major_order(sequence, cp, dim=1), rank_major)


def test_a_sequence_not_divisible_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match="2 \\* cp = 4 equal chunks"):
        split_sequence(torch.zeros(1, 6), 0, 2)


@dataclass(frozen=True)
class _Batch:
    tokens: torch.Tensor
    advantages: torch.Tensor
    old: torch.Tensor | None


def test_split_batch_cuts_per_token_fields_and_keeps_per_sequence_ones():
    batch = _Batch(tokens=torch.arange(16).view(2, 8), advantages=torch.tensor([1.0, 2.0]),
                   old=None)
    mine = split_batch(batch, 1, 2)
    assert mine.tokens.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert mine.advantages is batch.advantages and mine.old is None


def test_probe_share_pads_with_uncounted_positions_then_splits():
    probe = ProbeBatch(tokens=torch.arange(1, 7).view(1, 6), position_ids=torch.arange(6)[None],
                       mask=torch.ones(1, 6, dtype=torch.bool))
    shares = [context_parallel_share(probe, r, 2, multiple=4) for r in range(2)]
    # 6 positions padded to 8 (token 0, positions 6 and 7, not counted), chunks of 2.
    assert [s.tokens.tolist() for s in shares] == [[[1, 2, 0, 0]], [[3, 4, 5, 6]]]
    assert [s.position_ids.tolist() for s in shares] == [[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
    assert [s.mask.tolist() for s in shares] == [[[True, True, False, False]], [[True] * 4]]


# ----------------------------------------------------------------------------- attention


def _reference(query, key, value, scale):
    """Causal softmax attention of the last ``s_q`` positions of the keys' sequence."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    s_q, s_k = query.shape[2], key.shape[2]
    allowed = torch.arange(s_k)[None, :] <= torch.arange(s_q)[:, None] + (s_k - s_q)
    scores = (query @ key.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ value


def _chunk_case(seed: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """A CP chunk: 6 queries, the last 6 of 18 keys (chunk 2 of 3), grouped-query heads."""
    generator = torch.Generator().manual_seed(seed)

    def draw(s, heads):
        return torch.randn(BATCH, heads, s, HEAD_DIM, generator=generator, dtype=torch.float64)
    primals = (draw(6, HEADS), draw(18, KV_HEADS), draw(18, KV_HEADS))
    return primals, tuple(torch.randn_like(p) for p in primals)


def test_bottom_right_causal_attention_and_its_gradients_equal_the_masked_reference():
    primals, _ = _chunk_case(0)
    scale = HEAD_DIM**-0.5
    got_in = [p.clone().requires_grad_() for p in primals]
    want_in = [p.clone().requires_grad_() for p in primals]
    got = attention(*got_in, None, True, scale, bottom_right=True)
    want = _reference(*want_in, scale)
    assert _rel(got, want) < ATTENTION_REL_TOL_FP64
    grad_out = torch.randn_like(want)
    got.backward(grad_out)
    want.backward(grad_out)
    for mine, reference in zip(got_in, want_in, strict=True):
        assert _rel(mine.grad, reference.grad) < ATTENTION_REL_TOL_FP64


@pytest.mark.parametrize("query_block", [1024, 4])  # one block; two, the second ragged
def test_tangent_of_bottom_right_causal_attention_equals_the_reference_jvp(query_block,
                                                                           monkeypatch):
    monkeypatch.setattr(sdpa_forward_ad, "QUERY_BLOCK", query_block)
    primals, tangents = _chunk_case(1)
    scale = HEAD_DIM**-0.5
    with torch.no_grad(), fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(primals, tangents, strict=True)]
        got = fwAD.unpack_dual(attention(*duals, None, True, scale, bottom_right=True))
    want, want_tangent = torch.func.jvp(lambda q, k, v: _reference(q, k, v, scale), primals,
                                        tangents)
    assert _rel(got.primal, want) < ATTENTION_REL_TOL_FP64
    assert _rel(got.tangent, want_tangent) < ATTENTION_REL_TOL_FP64


# ----------------------------------------------------------------------------- config


def _cfg(*overrides: str):
    return load_config(None, ["parallel.device=cpu", "model.seq_length=32", *overrides])


def test_world_is_tp_times_cp_times_pp_times_dp():
    assert _cfg("parallel.cp=2").resolved(4).parallel.dp == 2
    assert _cfg("parallel.cp=2", "parallel.tp=2").resolved(4).parallel.dp == 1
    with pytest.raises(ValueError, match="parallel.tp \\* parallel.cp \\* parallel.pp = 4"):
        _cfg("parallel.cp=2", "parallel.tp=2").resolved(6)


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.cp=2", "model.attention=local"], "DotProductAttention refuses context"),
    (["parallel.cp=2", "model.num_moe_experts=4"], "dense models only"),
    (["parallel.cp=3"], "model.seq_length=32 must be a multiple of 6"),
    # 36 splits into 4 chunks, but not into 4 chunks of a multiple of TP=2.
    (["parallel.cp=2", "parallel.tp=2", "parallel.sp=true", "model.seq_length=36"],
     "model.seq_length=36 must be a multiple of 8"),
    (["parallel.cp=2", "parallel.cp_comm_type=p2p"], "acts only with parallel.cp > 1 and "
                                                      "model.attention=te"),
    (["parallel.cp_comm_type=a2a", "model.attention=te"], "acts only with parallel.cp > 1"),
    (["parallel.cp=0"], "parallel.cp=0 must be > 0"),
])
def test_context_parallel_settings_that_cannot_act_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        _cfg(*overrides).validate()


def test_te_context_parallelism_takes_its_communication_type():
    cfg = _cfg("parallel.cp=2", "model.attention=te", "parallel.cp_comm_type=all_gather")
    cfg.validate()
    assert cfg.parallel.cp_comm_type == "all_gather"
