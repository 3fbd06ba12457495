"""The character tokenizer's Hugging Face files: what a server that loads a model directory the
Hugging Face way (vLLM, SGLang) reads. ``transformers`` loads ``tokenizer.json`` and must encode
and decode exactly as ``CharTokenizer`` does, every embedding row included."""

from __future__ import annotations

import json

import pytest

from areal_fast.data.tokenizer import CharTokenizer, load_tokenizer

CHARS = "abcdefghijklmnopqrstuvwxyz ,.!?"


def test_tokenizer_json_encodes_and_decodes_as_the_char_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = CharTokenizer(CHARS)
    tok.save_pretrained(tmp_path, model_vocab_size=48)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ("hello, world!", "a", "zz yy ?", "..."):
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text, add_bos=False)
        assert hf.decode(tok.encode(text, add_bos=False)) == text
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert len(hf) == 48  # every embedding row has a name: a server can detokenize any sampled id
    assert hf.convert_ids_to_tokens(47) == "<unused47>"
    assert hf.decode([3, 4, 2], skip_special_tokens=True) == "ab"
    assert hf.decode([3, 4, 2], skip_special_tokens=False) == "ab<eos>"


def test_char_vocab_json_still_wins_when_loading(tmp_path):
    CharTokenizer(CHARS).save_pretrained(tmp_path, model_vocab_size=40)
    assert isinstance(load_tokenizer(tmp_path), CharTokenizer)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "<eos>"


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_refused():
    with pytest.raises(ValueError, match="model_vocab_size 5"):
        CharTokenizer(CHARS).hf_files(model_vocab_size=5)


def test_encode_text_spells_special_token_text_as_plain_characters(tmp_path):
    # tokenizer.json names <pad>, <bos>, <eos> special tokens: encode() turns their text into them,
    # encode_text() never does (text from a model, a user or a tool is text); CharTokenizer never did
    transformers = pytest.importorskip("transformers")
    from areal_fast.data.tokenizer import HFTokenizer, encode_text

    tok = CharTokenizer(CHARS + "<>")
    tok.save_pretrained(tmp_path)
    hf = HFTokenizer(transformers.AutoTokenizer.from_pretrained(str(tmp_path)))
    text = "a<eos>b <bos><pad>"
    chars = tok.encode(text, add_bos=False)
    assert tok.eos_token_id not in chars and len(chars) == len(text)
    assert hf.encode(text, add_bos=False).count(tok.eos_token_id) == 1  # encode() parses special-token text
    assert encode_text(hf, text) == encode_text(hf.tok, text) == encode_text(tok, text) == chars
    assert hf.encode_text(text) == tok.encode_text(text) == chars
