"""A checkpoint's model shape against the run's: a field added later (``model.qk_layernorm``)
reads as its default from a checkpoint written before it existed, and a real difference is
refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_logra.config import load_config
from megatron_logra.mcore.checkpointing.checkpoint import _check_model_matches


def _saved(cfg) -> dict:
    saved = cfg.to_dict()
    del saved["model"]["qk_layernorm"]  # as a checkpoint written before the field existed
    return saved


def test_a_checkpoint_without_qk_layernorm_matches_a_run_without_q_k_norms():
    cfg = load_config(None, []).resolved(1)
    _check_model_matches(_saved(cfg), cfg, Path("ckpt"), check_optimizer=False)


def test_a_checkpoint_without_q_k_norms_is_refused_for_a_run_with_them():
    old = load_config(None, []).resolved(1)
    run = load_config(None, ["model.qk_layernorm=true"]).resolved(1)
    with pytest.raises(ValueError, match="model.qk_layernorm: checkpoint False vs run True"):
        _check_model_matches(_saved(old), run, Path("ckpt"), check_optimizer=False)
