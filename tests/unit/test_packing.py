"""Sequence packing's plan and row layout (megatron_logra.packing), and its config section.

The plan is plain Python on a step's lengths; the claims are the ones the trainer relies on:
every sequence exactly once, no row over the budget, every data-parallel rank the same number
of microbatches, padding only to the multiples asked for, and a clear refusal of a sequence the
budget cannot hold. The attention and the trainers' use of it are tested on real models
(tests/distributed/test_packing.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from megatron_logra.config import load_config
from megatron_logra.packing import RowLayout, pack_row, plan_packs, unpack_row

# A realistic RL mix: prompts 50-300 tokens, responses log-normal around 600, capped at 4096.
RNG = random.Random(0)
RL_MIX = [RNG.randint(50, 300) + min(4096, int(RNG.lognormvariate(6.4, 0.6)))
          for _ in range(256)]


def _all_packs(plan):
    return [pack for packs in plan.ranks for pack in packs]


@pytest.mark.parametrize("algorithm", ["lpt", "karmarkar_karp"])
@pytest.mark.parametrize(("dp", "row_multiple", "sequence_multiple", "uniform"),
                         [(1, 1, 1, False), (2, 2, 1, False), (4, 4, 8, True)])
def test_plan_places_every_sequence_once_within_the_budget_and_balanced_over_dp(
        algorithm, dp, row_multiple, sequence_multiple, uniform):
    budget = 8192
    plan = plan_packs(RL_MIX, max_tokens=budget, dp_size=dp, algorithm=algorithm,
                      row_multiple=row_multiple, sequence_multiple=sequence_multiple,
                      uniform_rows=uniform)
    packs = _all_packs(plan)
    assert sorted(i for pack in packs for i in pack.indices) == list(range(len(RL_MIX)))
    assert len({len(packs) for packs in plan.ranks}) == 1 and len(plan.ranks) == dp
    for pack in packs:
        assert pack.row_length <= budget and pack.row_length % row_multiple == 0
        assert sum(pack.spans) == pack.row_length
        assert list(pack.lengths) == [RL_MIX[i] for i in pack.indices]
        # Each sequence padded to its multiple; only the last span takes the row's tail.
        for span, length in zip(pack.spans[:-1], pack.lengths[:-1], strict=True):
            assert span == -(-length // sequence_multiple) * sequence_multiple
    if uniform:
        assert {pack.row_length for pack in packs} == {plan.row_length}
    assert plan.real_tokens == sum(RL_MIX)
    # Fewest microbatches the budget allows at this DP size, give or take one.
    lower = -(-sum(RL_MIX) // (budget * dp))
    assert plan.microbatches <= lower + 1
    # Even tokens per rank: within one longest sequence.
    tokens = plan.rank_tokens()
    assert max(tokens) - min(tokens) <= max(RL_MIX)


def test_plan_pads_little_at_a_realistic_length_mix():
    """The benchmark's goal (<= 5% padding) holds for the plan itself, with TP=2 sequence
    parallelism's row multiple and one row shape per step (pipeline parallelism)."""
    plan = plan_packs(RL_MIX, max_tokens=8192, dp_size=2, row_multiple=2, uniform_rows=True)
    assert plan.padding_fraction <= 0.05


def test_the_two_algorithms_are_different_rules():
    lengths = [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
    lpt = plan_packs(lengths, max_tokens=40, dp_size=2, algorithm="lpt")
    kk = plan_packs(lengths, max_tokens=40, dp_size=2, algorithm="karmarkar_karp")
    assert [p.indices for p in _all_packs(lpt)] != [p.indices for p in _all_packs(kk)]
    for plan in (lpt, kk):
        assert sorted(p.tokens for p in _all_packs(plan)) == [27, 28]


def test_plan_is_deterministic():
    one = plan_packs(RL_MIX, max_tokens=8192, dp_size=4)
    two = plan_packs(list(RL_MIX), max_tokens=8192, dp_size=4)
    assert one == two


def test_microbatches_per_rank_are_a_multiple_for_the_interleaved_schedule():
    plan = plan_packs(RL_MIX, max_tokens=65536, dp_size=2, microbatch_multiple=4)
    assert plan.microbatches % 4 == 0 and plan.microbatches > 0


def test_a_sequence_longer_than_the_budget_is_refused_naming_both_numbers_and_the_fix():
    with pytest.raises(ValueError, match=r"sequence 1 takes 300 tokens, more than "
                       r"train\.packing\.max_tokens_per_microbatch=256.*raise train\.packing\."
                       r"max_tokens_per_microbatch to at least 300"):
        plan_packs([100, 300, 20], max_tokens=256, dp_size=1)
    with pytest.raises(ValueError, match=r"250 padded to a multiple of 8.*at least 256"):
        plan_packs([250], max_tokens=250, dp_size=1, sequence_multiple=8, row_multiple=2)


def test_fewer_sequences_than_data_parallel_ranks_are_refused():
    with pytest.raises(ValueError, match="2 sequences cannot give each of the 4"):
        plan_packs([5, 6], max_tokens=64, dp_size=4)


def test_row_layout_round_trips_values_and_restarts_positions():
    layout = RowLayout(lengths=(3, 2), spans=(4, 4), row_length=8)
    assert layout.cu_seqlens().tolist() == [0, 3, 5]
    assert layout.cu_seqlens_padded().tolist() == [0, 4, 8]
    assert layout.position_ids().tolist() == [[0, 1, 2, 0, 0, 1, 0, 0]]
    row = pack_row([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], layout, -1)
    assert row.tolist() == [[1, 2, 3, -1, 4, 5, -1, -1]]
    assert unpack_row(row, layout, fill=0).tolist() == [[1, 2, 3], [4, 5, 0]]


def test_unpacking_is_differentiable():
    layout = RowLayout(lengths=(2, 1), spans=(2, 2), row_length=4)
    row = torch.arange(4.0)[None].requires_grad_()
    unpack_row(row, layout).sum().backward()
    assert row.grad.tolist() == [[1.0, 1.0, 1.0, 0.0]]


# ----------------------------------------------------------------------------- config

def _resolved(command: str, *overrides: str, world: int = 1):
    return load_config(None, ["parallel.tp=1", *overrides], command=command).resolved(
        world, command)


def test_packing_defaults_to_on_for_rl_and_prompt_data_with_the_unpacked_microbatch_budget():
    rl = _resolved("rl", "model.seq_length=64", "train.micro_batch_size=4")
    assert rl.train.packing.enabled and rl.train.packing.max_tokens_per_microbatch == 256
    assert _resolved("sft").train.packing.enabled
    assert not _resolved("train").train.packing.enabled


def test_packing_a_corpus_is_refused():
    with pytest.raises(ValueError, match=r"train\.packing\.enabled=true with data\.format="
                       r"corpus.*no padding to pack away"):
        _resolved("train", "train.packing.enabled=true")


def test_a_budget_the_sequence_parallel_split_cannot_divide_is_refused():
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch=101 must be a multiple of "
                       r"parallel\.tp=2.*use 102"):
        _resolved("sft", "parallel.tp=2", "parallel.sp=true",
                  "train.packing.max_tokens_per_microbatch=101", world=2)


def test_a_budget_with_packing_turned_off_is_refused_and_a_presets_budget_is_kept_for_rl():
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch=128 with "
                       r"train\.packing\.enabled=false"):
        _resolved("sft", "train.packing.enabled=false",
                  "train.packing.max_tokens_per_microbatch=128")
    # A preset states its budget for the commands that pack; the corpus leaves it inert.
    corpus = _resolved("train", "train.packing.max_tokens_per_microbatch=128")
    assert not corpus.train.packing.enabled
    assert _resolved("rl", "train.packing.max_tokens_per_microbatch=128").train.packing.enabled


def test_an_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match=r"train\.packing\.algorithm='ffd' is not valid"):
        _resolved("sft", "train.packing.algorithm=ffd")


# ----------------------------------------------------------------------------- context parallel

def _cp_layout() -> RowLayout:
    # Spans padded to a multiple of 2 * cp = 4; the last takes the row's tail padding too.
    return RowLayout(lengths=(5, 2, 7), spans=(8, 4, 12), row_length=24)


def test_under_cp_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r_of_every_sequence():
    layout = _cp_layout()
    # Sequence spans [0, 8), [8, 12), [12, 24): chunks of 2, 1 and 3 tokens.
    assert layout.on_cp_rank(0, 2).held_positions().tolist() == [0, 1, 6, 7, 8, 11,
                                                                 12, 13, 14, 21, 22, 23]
    assert layout.on_cp_rank(1, 2).held_positions().tolist() == [2, 3, 4, 5, 9, 10,
                                                                 15, 16, 17, 18, 19, 20]
    row = torch.arange(24)[None]
    parts = [layout.on_cp_rank(r, 2).split_row(row) for r in range(2)]
    # The rank-major concatenation (an all-gather) puts every position back exactly once.
    order = torch.argsort(layout.on_cp_rank(0, 2).rank_major_positions())
    assert torch.cat(parts, dim=1)[:, order].tolist() == row.tolist()


@pytest.mark.parametrize("cp", [2, 3])
def test_under_cp_the_local_gather_index_and_the_per_sequence_split_agree_with_the_whole_row(cp):
    """What every rank's loss sees (its local row's values unpacked, beside its share of the
    per-sequence tensors) is, over the ranks, exactly the unsplit row's per-sequence values."""
    spans = (2 * cp * 2, 2 * cp, 2 * cp * 3)
    layout = RowLayout(lengths=(2 * cp * 2 - 1, 1, 2 * cp * 2 + 1), spans=spans,
                       row_length=sum(spans))
    values = [torch.randn(n) for n in layout.lengths]
    row = pack_row(values, layout, 0.0)
    whole = unpack_row(row, layout, fill=0.0)  # [N, L]
    seen = torch.zeros_like(whole)
    for rank in range(cp):
        mine = layout.on_cp_rank(rank, cp)
        local = unpack_row(mine.split_row(row), mine, fill=0.0)
        share = mine.split_per_sequence(whole, fill=0.0)
        valid = mine.gather_index()[1]
        assert local.tolist() == share.tolist()
        # The valid entries are each sequence's real tokens this rank holds: scatter them back.
        positions, held = mine.sequence_positions()
        for i in range(len(spans)):
            seen[i, positions[i][valid[i]]] += share[i][valid[i]]
        assert (share[~valid] == 0).all()
    assert torch.equal(seen, whole)


def test_under_cp_a_span_that_cannot_split_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match=r"spans \(6, 4\) cannot each be split into 2 \* cp = 4"):
        RowLayout(lengths=(5, 2), spans=(6, 4), row_length=10).on_cp_rank(0, 2)


@pytest.mark.parametrize(("tp", "sp", "cp", "want"),
                         [(2, True, 1, (1, 2)), (2, False, 2, (4, 4)), (2, True, 2, (8, 8))])
def test_the_plan_pads_every_sequence_to_2cp_tp_under_context_parallelism(tp, sp, cp, want):
    from megatron_logra.packing.plan import layout_multiples
    assert layout_multiples(tp, sp, cp) == want
    sequence_multiple, row_multiple = want
    plan = plan_packs(RL_MIX[:64], max_tokens=8192, dp_size=2, sequence_multiple=sequence_multiple,
                      row_multiple=row_multiple)
    for pack in _all_packs(plan):
        assert all(span % sequence_multiple == 0 for span in pack.spans)
        RowLayout.of(pack).on_cp_rank(0, cp)  # every span splits into 2 * cp chunks


def test_packing_stays_on_by_default_under_cp_and_its_budget_takes_the_cp_multiple():
    cp = _resolved("rl", "parallel.cp=2", "model.seq_length=64", "train.micro_batch_size=4",
                   world=2)
    assert cp.train.packing.enabled
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch=102 must be a multiple of "
                       r"4 \(2 x parallel\.cp=2.*use 104"):
        _resolved("rl", "parallel.cp=2", "model.seq_length=64",
                  "train.packing.max_tokens_per_microbatch=102", world=2)


def test_packing_under_cp_with_te_attention_is_off_by_default_and_refused_when_asked():
    te = ["parallel.cp=2", "model.attention=te", "model.seq_length=64"]
    assert not _resolved("rl", *te, world=2).train.packing.enabled
    with pytest.raises(ValueError, match=r"train\.packing\.enabled=true with parallel\.cp=2 and "
                       r"model\.attention=te.*model\.attention=sdpa"):
        _resolved("rl", *te, "train.packing.enabled=true", world=2)
