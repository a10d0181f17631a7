"""Shared fixtures: a small synthetic dataset made once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_logra.data.dataset_dir import SyntheticDataSpec, write_synthetic_dataset

# Small but with enough windows for a few dozen global batches of the tiny test models.
TEST_DATA_SPEC = SyntheticDataSpec(num_train=3000, num_eval=200, seed=0, vocab_size=96)


@pytest.fixture(scope="session")
def synthetic_data_dir(tmp_path_factory) -> Path:
    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "synthetic", TEST_DATA_SPEC)
