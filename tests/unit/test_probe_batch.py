"""The KL probe's pieces: which responses, which tokens, and how a piece is laid out.

A piece is one probe response at its real length (its prompt and its first
``probe_max_tokens`` response positions; nothing after them); the probe is ``probe_responses``
responses evenly spaced through the global batch, wherever they live.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.config import KLControlConfig
from megatron_logra.data.lm_batches import Microbatch
from megatron_logra.probe_batch import (
    ProbeBatch,
    ProbePiece,
    rollout_probe_batch,
    supervised_probe_batch,
)
from megatron_logra.probe_selection import probe_indices
from megatron_logra.rl.rollout import PaddedRollout

WIDTH = 40


def padded_rollout(prompts: list[int], responses: list[int]) -> PaddedRollout:
    """Rows of ``prompt + response`` tokens right-padded to WIDTH (token ids = position + 1,
    so a row's tokens say where they came from); response token j is the label of position
    ``prompt + j - 1``, as ``RolloutBatch.to_padded`` lays it out."""
    size = len(prompts)
    tokens = torch.zeros(size, WIDTH, dtype=torch.int64)
    mask = torch.zeros(size, WIDTH, dtype=torch.bool)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        tokens[i, :prompt + response] = torch.arange(1, prompt + response + 1)
        mask[i, prompt - 1:prompt - 1 + response] = True
    zeros = torch.zeros(size, WIDTH)
    return PaddedRollout(
        tokens=tokens, labels=tokens.roll(-1, 1), position_ids=torch.arange(WIDTH).repeat(size, 1),
        response_mask=mask, rollout_logprobs=zeros, sampling_logprobs=zeros,
        prompt_lengths=torch.tensor(prompts), response_lengths=torch.tensor(responses),
        finished=torch.ones(size, dtype=torch.bool), logprob_temperature=1.0,
    )


def settings(responses: int, max_tokens: int) -> KLControlConfig:
    return KLControlConfig(enabled=True, probe_responses=responses, probe_max_tokens=max_tokens)


def test_probe_max_tokens_counts_response_positions_not_the_prompt():
    """A prompt longer than probe_max_tokens still leaves the response in the probe (issue 21
    item 9: the probe was cut from position 0, leaving no response token)."""
    rollout = padded_rollout(prompts=[30], responses=[6])
    piece, = rollout_probe_batch(rollout, range(0, 1), settings(1, 8), torch.device("cpu"),
                                 global_size=1).pieces
    assert piece.counted == 6
    assert piece.length == 30 + 6 - 1  # the prompt, then every response position


def test_each_response_is_cut_after_its_probe_max_tokens_th_position():
    rollout = padded_rollout(prompts=[3, 5], responses=[10, 2])
    pieces = rollout_probe_batch(rollout, range(0, 2), settings(2, 4), torch.device("cpu"),
                                 global_size=2).pieces
    assert [p.counted for p in pieces] == [4, 2]
    assert [p.length for p in pieces] == [3 - 1 + 4, 5 - 1 + 2]
    for piece, row in zip(pieces, rollout.tokens, strict=True):
        assert torch.equal(piece.tokens[0], row[:piece.length])  # unpadded, in order
        assert torch.equal(piece.position_ids[0], torch.arange(piece.length))


def test_probe_responses_are_evenly_spaced_through_the_global_batch_first_included():
    assert probe_indices(8, 4) == [0, 2, 4, 6]
    assert probe_indices(6, 4) == [0, 1, 3, 4]
    assert probe_indices(10, 3) == [0, 3, 6]
    assert probe_indices(3, 8) == [0, 1, 2]  # a batch with fewer: all of it


def test_probe_is_the_same_responses_at_every_dp_size_and_spread_over_the_ranks():
    """probe_responses is global: the ranks' pieces together are the same global responses
    whatever the data-parallel size (so alpha does not depend on it), and no rank holds more
    than its share of them."""
    rollout = padded_rollout(prompts=[2, 3, 4, 5, 6, 7], responses=[3] * 6)
    for dp, most in ((1, 4), (2, 2), (3, 2)):
        share = len(rollout.tokens) // dp
        probed, per_rank = [], []
        for rank in range(dp):
            rows = slice(rank * share, (rank + 1) * share)
            mine = PaddedRollout(**{**rollout.__dict__, "tokens": rollout.tokens[rows],
                                    "position_ids": rollout.position_ids[rows],
                                    "response_mask": rollout.response_mask[rows]})
            batch = rollout_probe_batch(mine, range(rank * share, (rank + 1) * share),
                                        settings(4, 100), torch.device("cpu"), global_size=6)
            # A row's prompt length, read back from its tokens (position + 1 up to its end).
            probed += [piece.length - 3 + 1 for piece in batch.pieces]
            per_rank.append(len(batch.pieces))
        assert probed == [2, 3, 5, 6], dp  # the prompts of global responses 0, 1, 3, 4
        assert max(per_rank) == most, (dp, per_rank)


def test_supervised_probe_pieces_are_sequences_cut_after_their_last_counted_label():
    tokens = torch.arange(2 * 8).reshape(2, 8)
    loss_mask = torch.ones(2, 8)
    loss_mask[1, 5:] = 0  # padding at the end of the second sequence
    batch = Microbatch(tokens=tokens, labels=tokens, loss_mask=loss_mask,
                       position_ids=torch.arange(8).repeat(2, 1))
    pieces = supervised_probe_batch([batch], settings(8, 6), dp_rank=0, dp_size=1).pieces
    assert [p.length for p in pieces] == [6, 5]
    assert [p.counted for p in pieces] == [6, 5]
    # Rank 1 of two holds rows 2-3 of the global batch of 4; one probe response is row 0.
    assert supervised_probe_batch([batch], settings(1, 6), dp_rank=1, dp_size=2).pieces == ()
    # Two of them are rows 0 and 2: one on each rank.
    assert len(supervised_probe_batch([batch], settings(2, 6), dp_rank=1, dp_size=2).pieces) == 1


def test_padding_a_piece_adds_uncounted_tokens_after_it():
    piece = ProbePiece(tokens=torch.tensor([[5, 6, 7]]), position_ids=torch.tensor([[0, 1, 2]]),
                       mask=torch.tensor([[False, True, True]]))
    padded = piece.padded_to(6)
    assert padded.length == 6 and padded.counted == piece.counted
    assert torch.equal(padded.tokens[0, :3], piece.tokens[0])
    assert torch.equal(padded.position_ids[0], torch.arange(6))
    assert not padded.mask[0, 3:].any()
    assert piece.padded_to(3) is piece
    with pytest.raises(ValueError, match="cannot pad a 3-token probe piece to 2"):
        piece.padded_to(2)


def test_a_piece_is_one_row_with_a_bool_mask_shaped_like_its_tokens():
    row = torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"one row \[1, T\]"):
        ProbePiece(tokens=row.expand(2, 4), position_ids=row.expand(2, 4),
                   mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be bool"):
        ProbePiece(tokens=row, position_ids=row, mask=row)
    with pytest.raises(ValueError, match="must be shaped like its tokens"):
        ProbePiece(tokens=row, position_ids=row[:, :3], mask=row.bool())


def test_from_rows_keeps_whole_rows():
    tokens = torch.arange(12).reshape(3, 4)
    batch = ProbeBatch.from_rows(tokens, tokens, tokens > 5)
    assert [p.length for p in batch.pieces] == [4, 4, 4]
    assert batch.counted == 6 and batch.longest == 4
