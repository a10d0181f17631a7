"""``megatron-logra check`` (and every rank before it builds anything) refuses what a run could
not read -- data files, the tokenizer, model.init_checkpoint -- and prompts that do not fit
model.seq_length anywhere in the dataset, each with exit code 2 and a message naming the fix."""

from __future__ import annotations

import json

import pytest

from megatron_logra.cli import main as cli_main
from tests.chat_tokenizer import save_chat_tokenizer

CONFIG = "configs/demo_rl_cpu.yaml"
SHORT = "What is 2 plus 3?"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("own_data")
    tokenizer = save_chat_tokenizer(root / "tokenizer")
    data = root / "data"
    data.mkdir()
    long_prompt = "Natalia sold 48 clips in April and half as many in May. " * 4
    rows = {"train": [{"prompt": SHORT, "answer": "5"}] * 3 + [{"prompt": long_prompt,
                                                                 "answer": "72"}],
            "test": [{"prompt": SHORT, "answer": "5"}]}
    for split, items in rows.items():
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    return {"tokenizer": tokenizer, "data": data, "root": root}


def _check(capsys, command, *overrides):
    code = cli_main(["check", "--world-size", "1", command, CONFIG, "parallel.tp=1",
                     "rl.prompts_per_step=2", "train.micro_batch_size=2", *overrides])
    return code, capsys.readouterr().err


def _own(dataset, *extra):
    return (f"data.dir={dataset['data']}", f"data.tokenizer={dataset['tokenizer']}",
            "model.seq_length=128", *extra)


def test_a_dataset_that_fits_passes_and_an_unused_chat_template_is_pointed_out(dataset, capsys):
    code, err = _check(capsys, "rl", *_own(dataset))
    assert code == 0, err
    assert "has a chat template and data.prompt.chat_template=false" in err
    code, err = _check(capsys, "rl", *_own(dataset, "data.prompt.chat_template=true"))
    assert code == 0 and "note" not in err, err


def test_a_prompt_too_long_for_max_new_tokens_is_refused_naming_its_row(dataset, capsys):
    code, err = _check(capsys, "rl", *_own(dataset, "model.seq_length=64",
                                           "rl.sampling.max_new_tokens=8"))
    assert code == 2
    assert (f"1 of 4 training prompts with rl.sampling.max_new_tokens=8 do not fit: "
            f"{dataset['data'] / 'train.jsonl'}:4 takes ") in err
    assert "raise model.seq_length=64, lower rl.sampling.max_new_tokens=8" in err
    # sft checks the whole sample (prompt, target, stop token) against the same length.
    code, err = _check(capsys, "sft", *_own(dataset, "model.seq_length=64"))
    assert code == 2 and "1 of 4 supervised samples (prompt, target and stop token) do not fit" in err


@pytest.mark.parametrize(("overrides", "message"), [
    (("data.dir={root}/absent",), "data.dir='{root}/absent' does not exist"),
    (("data.tokenizer={root}/absent",), "tokenizer directory '{root}/absent' does not exist"),
    (("data.tokenizer=null",), "data.tokenizer is unset and data.dir='{root}/data' has no "
                               "tokenizer.model (the synthetic task's SentencePiece model); set "
                               "data.tokenizer to the model's Hugging Face tokenizer directory"),
    (("data.test_file=eval.parquet",), "data.test_file='eval.parquet': {root}/data/eval.parquet "
                                       "does not exist"),
    (("model.init_checkpoint={root}/absent",),
     "model.init_checkpoint='{root}/absent' does not exist"),
    (("model.init_checkpoint={root}/hf",),
     "model.init_checkpoint='{root}/hf' is a Hugging Face model directory, not a Megatron "
     "checkpoint; convert it first: python tools/convert_hf.py to-megatron {root}/hf OUT_DIR"),
    (("model.init_checkpoint={root}/converted",),
     "model.init_checkpoint='{root}/converted' holds a checkpoint in its model/ directory; set "
     "model.init_checkpoint={root}/converted/model"),
    (("model.init_checkpoint={root}/data",), "model.init_checkpoint='{root}/data' is not a "
                                             "complete checkpoint (no manifest.json)"),
])
def test_inputs_a_run_cannot_read_are_refused_before_any_rank_starts(dataset, capsys, overrides,
                                                                     message):
    root = dataset["root"]
    (root / "hf").mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        (root / "hf" / name).write_text("{}")
    (root / "converted" / "model").mkdir(parents=True, exist_ok=True)
    (root / "converted" / "model" / "manifest.json").write_text("{}")
    code, err = _check(capsys, "rl", *_own(dataset),
                       *(o.format(root=root) for o in overrides))
    assert code == 2
    assert f"megatron-logra: configuration error: {message.format(root=root)}" in err, err
