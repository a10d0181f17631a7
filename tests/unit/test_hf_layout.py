"""The torch-only row orders shared by the converter and the vLLM plugin
(:mod:`megatron_logra.hf_layout`): the per-group interleave of linear_qkv written out by hand,
[gate; up], the vocabulary padding, and each split the exact inverse of its fuse."""

from __future__ import annotations

import pytest
import torch

from megatron_logra import hf_layout

# 4 query heads in 2 groups of width 2: the interleave differs from [q; k; v].
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 2


def _rows(start: int, count: int, cols: int) -> torch.Tensor:
    """Rows whose first entry is their row number: the order is readable."""
    return torch.arange(start, start + count, dtype=torch.float32)[:, None].repeat(1, cols)


@pytest.mark.parametrize("cols", [3, None], ids=["weight", "bias"])
def test_fuse_qkv_interleaves_each_groups_query_heads_then_its_key_then_its_value_head(cols):
    q, k, v = _rows(0, 8, 3), _rows(100, 4, 3), _rows(200, 4, 3)
    if cols is None:
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
    fused = hf_layout.fuse_qkv(q, k, v, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    first = fused if cols is None else fused[:, 0]
    # group 0: query heads 0, 1 (rows 0-3), key head 0, value head 0; then group 1.
    expected = [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    assert first.tolist() == expected
    back = hf_layout.split_qkv(fused, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    for got, want in zip(back, (q, k, v), strict=True):
        assert torch.equal(got, want)


def test_split_gate_up_inverts_fuse_gate_up_and_gate_comes_first():
    gate, up = _rows(0, 5, 2), _rows(50, 5, 2)
    fc1 = hf_layout.fuse_gate_up(gate, up)
    assert fc1[:5].equal(gate) and fc1[5:].equal(up)
    got_gate, got_up = hf_layout.split_gate_up(fc1)
    assert got_gate.equal(gate) and got_up.equal(up)


def test_vocab_padding_appends_zero_rows_and_strip_removes_them():
    emb = _rows(1, 5, 3)
    padded = hf_layout.pad_vocab_rows(emb, 8)
    assert padded.shape == (8, 3) and padded[5:].eq(0).all()
    assert hf_layout.strip_vocab_rows(padded, 5).equal(emb)
    assert hf_layout.pad_vocab_rows(emb, 5) is emb
    with pytest.raises(ValueError, match="6 vocabulary rows do not fit a padded vocabulary of 5"):
        hf_layout.pad_vocab_rows(_rows(0, 6, 3), 5)
