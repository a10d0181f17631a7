"""HFTokenizer: a Hugging Face tokenizer from a local directory, with the trainer's interface.

The tokenizers are trained here (a tiny byte-level BPE), wrapped as PreTrainedTokenizerFast and
saved with save_pretrained; the reference for every id is the ``tokenizers`` object itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_logra.data.hf_tokenizer import HFTokenizer

CORPUS = ["What is 12 plus 7? 19", "Compute 45 minus 3. 42", "Calculate 100 plus 250. 350"]
TEXT = "Compute 12 plus 250? 262"


def _train(with_pad: bool, with_eos: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<eos>", "<pad>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    kwargs = {"unk_token": "<unk>"}
    if with_eos:
        kwargs["eos_token"] = "<eos>"
    if with_pad:
        kwargs["pad_token"] = "<pad>"
    return tokenizer, PreTrainedTokenizerFast(tokenizer_object=tokenizer, **kwargs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[object, Path]:
    raw, wrapped = _train(with_pad=True)
    directory = tmp_path_factory.mktemp("tok")
    wrapped.save_pretrained(directory)
    return raw, directory


def test_ids_and_vocab_size_match_the_trained_tokenizer(saved):
    raw, directory = saved
    tokenizer = HFTokenizer(directory)
    assert tokenizer.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    assert tokenizer.eos_id == raw.token_to_id("<eos>")
    assert tokenizer.pad_id == raw.token_to_id("<pad>")
    # No special tokens are added: exactly the tokenizer's own encoding.
    assert tokenizer.encode(TEXT) == raw.encode(TEXT).ids


def test_decode_inverts_encode_and_drops_eos_like_sentencepiece(saved):
    _, directory = saved
    tokenizer = HFTokenizer(directory)
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode([*ids, tokenizer.eos_id]) == TEXT


def test_pad_falls_back_to_eos_without_a_pad_token(tmp_path):
    raw, wrapped = _train(with_pad=False)
    wrapped.save_pretrained(tmp_path)
    tokenizer = HFTokenizer(tmp_path)
    assert tokenizer.pad_id == tokenizer.eos_id == raw.token_to_id("<eos>")


def test_tokenizer_without_eos_is_refused(tmp_path):
    _, wrapped = _train(with_pad=True, with_eos=False)
    wrapped.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no EOS token"):
        HFTokenizer(tmp_path)


def test_missing_or_empty_directory_is_refused_without_a_download(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        HFTokenizer(tmp_path / "absent")
    # An existing directory without tokenizer files: local_files_only must stop transformers
    # from treating the name as a hub repository.
    with pytest.raises(ValueError, match="holds no loadable Hugging Face tokenizer"):
        HFTokenizer(tmp_path)
