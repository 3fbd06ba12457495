"""Tokenizers the controller uses: a character-level one for the shipped tiny task, or any
Hugging Face tokenizer from a model directory.

The controller only needs ``encode(text) -> ids``, ``decode(ids) -> text``, ``eos_token_id``
and ``pad_token_id``; inference servers get token ids (they never tokenize for RL).

Text that came from a model, a user or a tool is encoded with :func:`encode_text`: as plain
text, never as control tokens. A Hugging Face tokenizer's ``encode`` turns the *text* of a
special token (``<|im_start|>``) into the token itself, even with ``add_special_tokens=False``, so
a message or a program's output could open turns of its own; ``encode_text`` spells it with the
ordinary tokens of its characters. The character tokenizer has no such parsing (``<eos>`` is five
characters to it).
"""

from __future__ import annotations

import json
from pathlib import Path

CHAR_VOCAB_FILE = "char_vocab.json"
HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIALS = ("<pad>", "<bos>", "<eos>")
UNUSED_TOKEN = "<unused{}>"  # the names of the model's embedding rows past the characters


class CharTokenizer:
    """One token per character; ids 0..2 are <pad>, <bos>, <eos>. Unknown characters are an error
    (naming the character), never silently dropped."""

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars):
            raise ValueError(f"CharTokenizer: duplicate characters in {chars!r}")
        self.chars = chars
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self._stoi = {c: i + len(SPECIALS) for i, c in enumerate(chars)}
        self._itos = {i: c for c, i in self._stoi.items()}

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.chars)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        try:
            ids = [self._stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"CharTokenizer: character {e.args[0]!r} is not in the vocabulary {self.chars!r}") from e
        return ([self.bos_token_id] if add_bos else []) + ids

    def encode_text(self, text: str) -> list[int]:
        """Plain text, no BOS (see :func:`encode_text`): as ``encode(text, add_bos=False)``, since this
        tokenizer never reads special-token text as a special token."""
        return self.encode(text, add_bos=False)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i in self._itos:
                out.append(self._itos[i])
            elif i >= len(SPECIALS):  # padding rows of the embedding: visible, so never "correct"
                out.append("\ufffd")
            elif not skip_special_tokens:
                out.append(SPECIALS[i])
        return "".join(out)

    def save_pretrained(self, path: str | Path, model_vocab_size: int | None = None) -> None:
        """``char_vocab.json`` (ours) and the same vocabulary as a Hugging Face fast tokenizer
        (``tokenizer.json`` + ``tokenizer_config.json``), so that any server that loads a model
        directory the Hugging Face way (vLLM, SGLang) can serve it. ``model_vocab_size``: the
        model's embedding rows; those past the characters get names of their own (``<unusedN>``),
        so that a server can turn every id the model may sample into text."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CHAR_VOCAB_FILE).write_text(json.dumps({"chars": self.chars, "specials": list(SPECIALS)}))
        tok_json, tok_config = self.hf_files(model_vocab_size)
        (path / HF_TOKENIZER_FILE).write_text(json.dumps(tok_json, ensure_ascii=False, indent=1))
        (path / HF_TOKENIZER_CONFIG_FILE).write_text(json.dumps(tok_config, indent=1))

    def hf_files(self, model_vocab_size: int | None = None) -> tuple[dict, dict]:
        """The contents of ``tokenizer.json`` and ``tokenizer_config.json`` for this vocabulary: a
        word-level model over single characters (the pre-tokenizer splits the text into characters,
        the decoder joins them), ``<pad>``, ``<bos>`` and ``<eos>`` as special tokens. Written as
        plain JSON (the format of the ``tokenizers`` library): no tokenizer library is needed to
        write it; ``tests/data/test_tokenizer.py`` loads it with ``transformers``."""
        n = self.vocab_size if model_vocab_size is None else int(model_vocab_size)
        if n < self.vocab_size:
            raise ValueError(f"model_vocab_size {n} is smaller than the tokenizer's {self.vocab_size} tokens")
        names = [*SPECIALS, *self.chars] + [UNUSED_TOKEN.format(i) for i in range(self.vocab_size, n)]
        added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": True}
                 for i, t in enumerate(names) if i < len(SPECIALS) or i >= self.vocab_size]
        tok_json = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {"type": "Split", "pattern": {"String": ""}, "behavior": "Isolated", "invert": False},
            "post_processor": None,
            "decoder": {"type": "Fuse"},
            "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(names)}, "unk_token": SPECIALS[0]},
        }
        tok_config = {
            "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30,
            "pad_token": SPECIALS[self.pad_token_id], "bos_token": SPECIALS[self.bos_token_id],
            "eos_token": SPECIALS[self.eos_token_id], "unk_token": SPECIALS[0],
            "add_bos_token": False, "clean_up_tokenization_spaces": False,
        }
        return tok_json, tok_config

    @classmethod
    def from_pretrained(cls, path: str | Path) -> CharTokenizer:
        data = json.loads((Path(path) / CHAR_VOCAB_FILE).read_text())
        return cls(data["chars"])


class HFTokenizer:
    """Adapter over a ``transformers`` tokenizer with the same small surface as CharTokenizer."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_token_id = tok.eos_token_id
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.bos_token_id = tok.bos_token_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """The tokenizer's own encoding: the text of a special token becomes that token (a chat-templated
        prompt's ``<|im_start|>`` must); for text from a model, a user or a tool use :meth:`encode_text`."""
        return list(self.tok.encode(text, add_special_tokens=add_bos))

    def encode_text(self, text: str) -> list[int]:
        """Plain text, no BOS (see :func:`encode_text`)."""
        return hf_plain_ids(self.tok, text)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, prompt: str) -> str:
        return self.tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                            add_generation_prompt=True)


def hf_plain_ids(tok, text: str) -> list[int]:
    """A ``transformers`` tokenizer's ids of ``text`` as plain text: no BOS/EOS added, and the text of
    a special token spelled with ordinary tokens (``split_special_tokens``), never the token itself."""
    if not text:
        return []
    return list(tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as plain text that continues a sequence (a message's content, a tool's
    output, feedback): no BOS, and no control token made from its characters. ``tokenizer``: a
    CharTokenizer, an HFTokenizer, a ``transformers`` tokenizer, or any object with
    ``encode(text, add_bos=False)`` that has no special-token text (the tests' small tokenizers)."""
    own = getattr(tokenizer, "encode_text", None)
    if own is not None:
        return list(own(text))
    if hasattr(tokenizer, "all_special_tokens"):  # a transformers tokenizer, not wrapped
        return hf_plain_ids(tokenizer, text)
    return list(tokenizer.encode(text, add_bos=False))


def load_tokenizer(path: str | Path):
    """CharTokenizer when ``path`` holds char_vocab.json, else ``AutoTokenizer.from_pretrained``."""
    path = Path(path)
    if (path / CHAR_VOCAB_FILE).is_file():
        return CharTokenizer.from_pretrained(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(str(path)))
