"""The rollout contract's pure parts: sampling params, the sampling rule, counter-based uniforms,
data-parallel shares, and the RolloutBatch / trainer-view containers, against hand-computed
values."""

from __future__ import annotations

import math
import re

import pytest
import torch

from megatron_logra.rl.rollout import (
    RolloutBatch,
    SamplingParams,
    data_parallel_share,
    sample_next_tokens,
    sampling_uniforms,
    validate_prompts,
)

# float32 log-softmax vs a float64 reference on logits of size <= 10: a few fp32 ulps of ~10.
FP32_LOGPROB_ABS_TOL = 1e-5
# 1% critical value of the Kolmogorov-Smirnov statistic for N samples: 1.63 / sqrt(N).
KS_CRITICAL_COEFFICIENT = 1.63


def make_batch(
    indices: list[int],
    prompts: list[list[int]],
    responses: list[list[int]],
    logprobs: list[list[float]],
    finished: list[bool],
    *,
    sampling_logprobs: list[list[float]] | None = None,
) -> RolloutBatch:
    width = max(len(r) for r in responses)

    def padded(rows: list[list], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=dtype)

    return RolloutBatch(
        sequence_indices=tuple(indices),
        prompt_tokens=tuple(tuple(p) for p in prompts),
        response_tokens=padded(responses, torch.int64),
        response_lengths=torch.tensor([len(r) for r in responses], dtype=torch.int64),
        logprobs=padded(logprobs, torch.float32),
        sampling_logprobs=padded(sampling_logprobs or logprobs, torch.float32),
        finished=torch.tensor(finished, dtype=torch.bool),
        logprob_temperature=1.0,
    )


def stratified_uniforms(count: int) -> torch.Tensor:
    """u_k = (k + 1/2) / count: inverse-CDF sampling then hits every probability exactly."""
    return (torch.arange(count, dtype=torch.float64) + 0.5) / count


# ----------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens=0 must be a positive integer"),
        ({"max_new_tokens": 2.0}, "max_new_tokens=2.0 must be a positive integer"),
        ({"max_new_tokens": 4, "temperature": -0.1}, "temperature=-0.1 must be a finite number"),
        ({"max_new_tokens": 4, "temperature": math.inf}, "temperature=inf must be a finite"),
        ({"max_new_tokens": 4, "top_p": 0.0}, "top_p=0.0 must be in (0, 1]"),
        ({"max_new_tokens": 4, "top_p": 1.5}, "top_p=1.5 must be in (0, 1]"),
        ({"max_new_tokens": 4, "stop_ids": (3, -1)},
         "stop_ids=(3, -1) must be a tuple of token ids >= 0"),
    ],
)
def test_sampling_params_reject_invalid_fields_naming_them(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        SamplingParams(**kwargs)


def test_logprob_temperature_is_the_sampling_temperature_and_one_for_greedy():
    assert SamplingParams(max_new_tokens=1, temperature=0.7).logprob_temperature == 0.7
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
    assert greedy.greedy and greedy.logprob_temperature == 1.0


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ("abc", "prompts must be a list of token-id lists"),
        ([[1, 2], []], r"prompts\[1\]=\[\] must be a non-empty list"),
        ([[1, 10]], r"prompts\[0\]\[1\]=10 is not a token id in \[0, 10\)"),
        ([[1, -1]], r"prompts\[0\]\[1\]=-1 is not a token id"),
        ([[1, 2.0]], r"prompts\[0\]\[1\]=2.0 is not a token id"),
    ],
)
def test_validate_prompts_rejects_malformed_prompts_naming_the_entry(prompts, message):
    with pytest.raises(ValueError, match=message):
        validate_prompts(prompts, vocab_size=10)


# ----------------------------------------------------------------------------- shares, uniforms


def test_data_parallel_shares_are_contiguous_balanced_and_cover_the_batch_once():
    for num_sequences in range(10):
        for dp_size in range(1, 5):
            shares = [data_parallel_share(num_sequences, r, dp_size) for r in range(dp_size)]
            assert [i for share in shares for i in share] == list(range(num_sequences))
            sizes = [len(share) for share in shares]
            assert max(sizes) - min(sizes) <= 1, (num_sequences, dp_size, sizes)


def test_sampling_uniforms_depend_only_on_seed_index_and_step():
    batch = sampling_uniforms(7, [4, 9, 2], step=3)
    assert torch.equal(sampling_uniforms(7, [4, 9, 2], step=3), batch)
    # Each value belongs to its (seed, index, step): the same alone or in another batch order.
    assert torch.equal(sampling_uniforms(7, [2, 4, 9], step=3), batch[[2, 0, 1]])
    assert torch.equal(sampling_uniforms(7, [9], step=3), batch[1:2])
    assert batch.dtype == torch.float64


def test_sampling_uniforms_differ_across_seeds_indices_and_steps():
    values = [
        float(sampling_uniforms(seed, [index], step)[0])
        for seed in range(3) for index in range(20) for step in range(20)
    ]
    assert len(set(values)) == len(values)


def test_sampling_uniforms_are_uniform_on_the_unit_interval():
    draws = torch.cat([sampling_uniforms(11, range(200), step) for step in range(100)])
    count = draws.numel()
    assert 0.0 <= float(draws.min()) and float(draws.max()) < 1.0
    ordered = draws.sort().values
    ranks = torch.arange(1, count + 1, dtype=torch.float64) / count
    ks = torch.maximum(ranks - ordered, ordered - (ranks - 1.0 / count)).max()
    assert float(ks) < KS_CRITICAL_COEFFICIENT / math.sqrt(count), float(ks)


# ----------------------------------------------------------------------------- sampling rule


def test_greedy_picks_the_lowest_id_of_the_maximal_real_logits_with_certain_probability():
    logits = torch.tensor([[1.0, 3.0, 3.0, 9.0], [0.5, -1.0, 2.0, 50.0]])
    chosen = sample_next_tokens(
        logits, torch.zeros(2, dtype=torch.float64), SamplingParams(max_new_tokens=1,
                                                                    temperature=0), vocab_size=3
    )
    assert chosen.tokens.tolist() == [1, 2]  # column 3 is vocabulary padding
    expected = [
        math.log(math.exp(3) / (math.exp(1) + 2 * math.exp(3))),
        math.log(math.exp(2) / (math.exp(0.5) + math.exp(-1) + math.exp(2))),
    ]
    assert chosen.logprobs.tolist() == pytest.approx(expected, abs=FP32_LOGPROB_ABS_TOL)
    assert chosen.sampling_logprobs.tolist() == [0.0, 0.0]


def test_top_p_one_samples_the_temperature_scaled_distribution_exactly():
    count, temperature = 1000, 0.5
    probs = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    # logits = T * log p: softmax(logits / T) = p; a padding column that must never be drawn.
    logits = torch.cat([temperature * probs.log(), torch.tensor([100.0], dtype=torch.float64)])
    chosen = sample_next_tokens(
        logits.float()[None].repeat(count, 1), stratified_uniforms(count),
        SamplingParams(max_new_tokens=1, temperature=temperature), vocab_size=3,
    )
    assert torch.bincount(chosen.tokens, minlength=4).tolist() == [200, 300, 500, 0]
    expected = probs.log()[chosen.tokens]
    assert torch.allclose(chosen.logprobs.double(), expected, atol=FP32_LOGPROB_ABS_TOL)
    assert torch.equal(chosen.sampling_logprobs, chosen.logprobs)


def test_top_p_keeps_the_smallest_most_probable_set_reaching_top_p_renormalised():
    count = 1000
    probs = torch.tensor([0.1, 0.5, 0.3, 0.1], dtype=torch.float64)
    # Nucleus for top_p = 0.7: {1} has mass 0.5 < 0.7, {1, 2} has 0.8 >= 0.7; mass 0.8.
    chosen = sample_next_tokens(
        probs.log().float()[None].repeat(count, 1), stratified_uniforms(count),
        SamplingParams(max_new_tokens=1, top_p=0.7), vocab_size=4,
    )
    assert torch.bincount(chosen.tokens, minlength=4).tolist() == [0, 625, 375, 0]
    assert torch.allclose(
        chosen.logprobs.double(), probs.log()[chosen.tokens], atol=FP32_LOGPROB_ABS_TOL
    )
    assert torch.allclose(
        chosen.sampling_logprobs.double(), (probs / 0.8).log()[chosen.tokens],
        atol=FP32_LOGPROB_ABS_TOL,
    )


def test_top_p_breaks_ties_at_the_nucleus_boundary_towards_lower_ids():
    count = 100
    probs = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
    # top_p = 0.6: token 1 (0.5), then of the tied tokens 0 and 2 only the lower id joins.
    chosen = sample_next_tokens(
        probs.log().float()[None].repeat(count, 1), stratified_uniforms(count),
        SamplingParams(max_new_tokens=1, top_p=0.6), vocab_size=3,
    )
    assert torch.bincount(chosen.tokens, minlength=3).tolist() == [33, 67, 0]


def test_sample_next_tokens_rejects_mismatched_shapes():
    params = SamplingParams(max_new_tokens=1)
    with pytest.raises(ValueError, match="must be \\[B, V\\] with V >= vocab_size=5"):
        sample_next_tokens(torch.zeros(2, 4), torch.zeros(2, dtype=torch.float64), params, 5)
    with pytest.raises(ValueError, match="uniforms \\(3,\\) must be \\[B\\] = \\[2\\]"):
        sample_next_tokens(torch.zeros(2, 4), torch.zeros(3, dtype=torch.float64), params, 4)


# ----------------------------------------------------------------------------- containers


def test_rollout_batch_rejects_inconsistent_fields():
    good = make_batch([0, 1], [[5], [6]], [[1, 2], [3]], [[-1.0, -2.0], [-3.0]], [False, True])
    with pytest.raises(ValueError, match="must be distinct and ascending"):
        make_batch([1, 0], [[5], [6]], [[1], [3]], [[-1.0], [-3.0]], [False, True])
    with pytest.raises(ValueError, match="2 sequence_indices but 1 prompts"):
        RolloutBatch(**{**vars(good), "prompt_tokens": ((5,),)})
    with pytest.raises(ValueError, match="positions beyond a response's length must hold 0"):
        RolloutBatch(**{**vars(good), "response_tokens": torch.tensor([[1, 2], [3, 4]])})
    with pytest.raises(ValueError, match=r"response_lengths must be in \[1, 2\]"):
        RolloutBatch(**{**vars(good), "response_lengths": torch.tensor([3, 1])})
    with pytest.raises(ValueError, match="logprobs must be float32"):
        RolloutBatch(**{**vars(good), "logprobs": good.logprobs.double()})


def test_responses_strip_the_padding():
    batch = make_batch([0, 1], [[5], [6]], [[1, 2], [3]], [[-1.0, -2.0], [-3.0]], [False, True])
    assert batch.responses() == [[1, 2], [3]]
    assert batch.response_mask().tolist() == [[True, True], [True, False]]


def test_to_padded_aligns_labels_response_mask_and_logprobs_with_the_next_token():
    batch = make_batch(
        [3, 4], [[5, 6], [7]], [[8, 9, 2], [3]], [[-1.0, -2.0, -3.0], [-4.0]], [True, False],
        sampling_logprobs=[[-0.5, -1.5, -2.5], [-3.5]],
    )
    padded = batch.to_padded(pad_id=0, pad_to_multiple_of=4)
    assert padded.tokens.tolist() == [[5, 6, 8, 9, 2, 0, 0, 0], [7, 3, 0, 0, 0, 0, 0, 0]]
    assert padded.labels.tolist() == [[6, 8, 9, 2, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0, 0]]
    assert padded.response_mask.tolist() == [
        [False, True, True, True, False, False, False, False],
        [True, False, False, False, False, False, False, False],
    ]
    assert padded.rollout_logprobs.tolist() == [
        [0.0, -1.0, -2.0, -3.0, 0.0, 0.0, 0.0, 0.0], [-4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    ]
    assert padded.sampling_logprobs[0, 1:4].tolist() == [-0.5, -1.5, -2.5]
    assert padded.position_ids.tolist() == [list(range(8))] * 2
    assert padded.prompt_lengths.tolist() == [2, 1]
    assert padded.response_lengths.tolist() == [3, 1]
    assert padded.finished.tolist() == [True, False]
    # Every masked label is the response token the log-prob belongs to.
    assert padded.labels[padded.response_mask].tolist() == [8, 9, 2, 3]


def test_merged_orders_sequences_by_global_index_and_rejects_overlaps():
    second = make_batch([2, 3], [[7], [8]], [[4, 5, 6], [7]], [[-4.0, -5.0, -6.0], [-7.0]],
                        [True, False])
    first = make_batch([0, 1], [[5], [6]], [[1], [2, 3]], [[-1.0], [-2.0, -3.0]], [False, True])
    merged = RolloutBatch.merged([second, first])
    assert merged.sequence_indices == (0, 1, 2, 3)
    assert merged.prompt_tokens == ((5,), (6,), (7,), (8,))
    assert merged.responses() == [[1], [2, 3], [4, 5, 6], [7]]
    assert merged.logprobs[2].tolist() == [-4.0, -5.0, -6.0]
    assert merged.finished.tolist() == [False, True, True, False]
    with pytest.raises(ValueError, match="share sequence indices"):
        RolloutBatch.merged([first, first])
