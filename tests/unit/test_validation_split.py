"""The synthetic task's validation split (issue 15 item 7): for choosing settings, disjoint from
the held-out test split runs report and from training, and without changing either of them."""

from __future__ import annotations

import json
import re

import pytest

from megatron_logra.config import EVAL_SPLITS, load_config
from megatron_logra.data.dataset_dir import (
    EVAL_SPLIT_FILES,
    SyntheticDataSpec,
    write_synthetic_dataset,
)

SPEC = SyntheticDataSpec(num_train=400, num_eval=60, num_valid=60, seed=3)


def _canonical(prompt: str) -> tuple[int, str, int]:
    a, op, b = re.search(r"(\d+) (plus|minus) (\d+)", prompt).groups()
    return int(a), op, int(b)


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("valid")
    without = SyntheticDataSpec(num_train=SPEC.num_train, num_eval=SPEC.num_eval, seed=SPEC.seed)
    return write_synthetic_dataset(root / "with", SPEC), write_synthetic_dataset(root / "no", without)


def test_validation_problems_are_disjoint_from_test_and_train_problems(dirs):
    out = dirs[0]
    keys = {name: {_canonical(r["prompt"]) for r in _rows(out / name)}
            for name in ("train.jsonl", "eval.jsonl", "valid.jsonl")}
    assert len(_rows(out / "valid.jsonl")) == SPEC.num_valid
    assert not keys["valid.jsonl"] & keys["eval.jsonl"]
    assert not keys["valid.jsonl"] & keys["train.jsonl"]


def test_a_validation_split_leaves_train_and_test_problems_byte_identical(dirs):
    with_valid, without = dirs
    for name in ("train.jsonl", "eval.jsonl", "corpus.txt", "tokens.npy"):
        assert (with_valid / name).read_bytes() == (without / name).read_bytes(), name
    assert not (without / "valid.jsonl").exists()


def test_eval_split_names_map_to_files_and_an_unknown_split_is_refused():
    assert set(EVAL_SPLITS) == set(EVAL_SPLIT_FILES)
    assert load_config(None, ["rl.eval.split=validation"], command="rl").rl.eval.split == \
        "validation"
    with pytest.raises(ValueError, match=r"rl\.eval\.split"):
        load_config(None, ["rl.eval.split=held_out"], command="rl")
