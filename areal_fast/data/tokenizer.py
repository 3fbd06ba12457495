"""Tokenizers the controller uses: a character-level one for the shipped tiny task, or any
Hugging Face tokenizer from a model directory.

The controller only needs ``encode(text) -> ids``, ``decode(ids) -> text``, ``eos_token_id``
and ``pad_token_id``; inference servers get token ids (they never tokenize for RL).
"""

from __future__ import annotations

import json
from pathlib import Path

CHAR_VOCAB_FILE = "char_vocab.json"
SPECIALS = ("<pad>", "<bos>", "<eos>")


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

    def save_pretrained(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / CHAR_VOCAB_FILE).write_text(json.dumps({"chars": self.chars, "specials": list(SPECIALS)}))

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
        return list(self.tok.encode(text, add_special_tokens=add_bos))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, prompt: str) -> str:
        return self.tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                            add_generation_prompt=True)


def load_tokenizer(path: str | Path):
    """CharTokenizer when ``path`` holds char_vocab.json, else ``AutoTokenizer.from_pretrained``."""
    path = Path(path)
    if (path / CHAR_VOCAB_FILE).is_file():
        return CharTokenizer.from_pretrained(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(str(path)))
