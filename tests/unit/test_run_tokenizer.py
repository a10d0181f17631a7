"""The run's tokenizer and the embedding rows that follow from it."""

from __future__ import annotations

import pytest

from megatron_logra.config import load_config
from megatron_logra.data.run_tokenizer import embedding_rows, load_run_tokenizer


def test_embedding_rows_follow_the_tokenizer_unless_model_vocab_size_is_set(
    synthetic_data_dir,
):
    cfg = load_config(None, [f"data.dir={synthetic_data_dir}"])
    tokenizer = load_run_tokenizer(cfg)
    assert embedding_rows(cfg, tokenizer) == tokenizer.vocab_size
    wider = load_config(None, [f"data.dir={synthetic_data_dir}",
                               f"model.vocab_size={tokenizer.vocab_size + 40}"])
    assert embedding_rows(wider, tokenizer) == tokenizer.vocab_size + 40


def test_model_vocab_size_below_the_tokenizer_raises_value_error_naming_both(
    synthetic_data_dir,
):
    cfg = load_config(None, [f"data.dir={synthetic_data_dir}", "model.vocab_size=10"])
    tokenizer = load_run_tokenizer(cfg)
    with pytest.raises(ValueError, match=rf"model.vocab_size=10 .* {tokenizer.vocab_size} ids"):
        embedding_rows(cfg, tokenizer)


def test_data_tokenizer_directory_replaces_the_data_dir_tokenizer(synthetic_data_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(["What is 1 plus 2? 3"] * 5,
                                trainers.BpeTrainer(vocab_size=40, special_tokens=["<unk>", "<e>"]))
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<e>",
                            unk_token="<unk>").save_pretrained(tmp_path / "tok")
    cfg = load_config(None, [f"data.dir={synthetic_data_dir}", "data.format=prompts",
                             f"data.tokenizer={tmp_path / 'tok'}"])
    tokenizer = load_run_tokenizer(cfg)
    assert tokenizer.eos_id == 1
    assert tokenizer.decode(tokenizer.encode("What is 1 plus 2?")) == "What is 1 plus 2 ?"
