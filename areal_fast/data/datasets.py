"""Prompt datasets: the synthetic task, local JSONL / Parquet files, Hugging Face `datasets`.

A dataset is a list of :class:`PromptRow` (index, text, task). ``task`` is what the reward
function receives: a dict with 'answer' and, when the source has it, 'tests'. The training
order is a seeded permutation, cycled epoch after epoch, so the controller's data position
(one integer) says exactly which prompts were already taken.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from areal_fast.config import DataConfig


@dataclass(frozen=True, slots=True)
class PromptRow:
    index: int
    """Row number inside its source (stable across runs)."""
    text: str
    """Prompt after the template (and chat template)."""
    task: dict
    """Passed to the reward function: {'answer': ..., 'tests': ...}."""


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from e
    return rows


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {path} needs pyarrow (`pip install pyarrow`)") from e
    return pq.read_table(str(path)).to_pylist()


def _read_hf(spec: str, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"data source {spec!r} needs the Hugging Face `datasets` library "
                          "(`pip install datasets`)") from e
    parts = spec[len("hf:"):].split(":")
    name, conf = parts[0], (parts[1] if len(parts) > 1 else None)
    return list(datasets.load_dataset(name, conf, split=split))


def read_rows(source: str, cfg: DataConfig, split: str, seed: int) -> list[dict]:
    """Raw rows of a source ('synthetic:reverse', *.jsonl, *.parquet, 'hf:NAME[:CONFIG]')."""
    if source.startswith("synthetic:"):
        kind = source.split(":", 1)[1]
        if kind != "reverse":
            raise ValueError(f"data source {source!r}: the only synthetic task is 'synthetic:reverse'")
        from areal_fast.data import tiny_task

        return tiny_task.generate(cfg.synthetic, "train" if split == "train" else "eval", seed)
    if source.startswith("hf:"):
        return _read_hf(source, cfg.split if split == "train" else cfg.eval_split)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"data file {source!r} does not exist")
    if path.suffix == ".jsonl" or path.name.endswith(".jsonl.gz"):
        return _read_jsonl(path)
    if path.suffix == ".parquet":
        return _read_parquet(path)
    raise ValueError(f"data file {source!r}: expected .jsonl or .parquet")


def build_prompts(rows: list[dict], cfg: DataConfig, tokenizer=None, source: str = "") -> list[PromptRow]:
    """Apply the template (and chat template) and pick the task fields; a missing prompt field is
    an error naming the row and the key."""
    out = []
    for i, row in enumerate(rows):
        if cfg.prompt_key not in row:
            raise KeyError(f"{source or 'data'} row {i}: no field {cfg.prompt_key!r} (data.prompt_key); "
                           f"fields: {sorted(row)}")
        text = cfg.prompt_template.format(prompt=row[cfg.prompt_key])
        if cfg.chat_template and tokenizer is not None:
            text = tokenizer.apply_chat_template(text)
        task = {}
        if cfg.answer_key in row:
            task["answer"] = row[cfg.answer_key]
        if cfg.tests_key in row:
            task["tests"] = row[cfg.tests_key]
        if not task:
            raise KeyError(f"{source or 'data'} row {i}: neither {cfg.answer_key!r} (data.answer_key) nor "
                           f"{cfg.tests_key!r} (data.tests_key) is present")
        out.append(PromptRow(index=i, text=text, task=task))
    return out


def load_split(cfg: DataConfig, split: str, seed: int, tokenizer=None) -> list[PromptRow]:
    """'train' or 'eval' prompts. The eval split is empty when no held-out source is configured."""
    if split == "train":
        source = cfg.train
    else:
        source = cfg.eval or (cfg.train if cfg.train.startswith("synthetic:") else None)
        if source is None:
            return []
    return build_prompts(read_rows(source, cfg, split, seed), cfg, tokenizer, source)


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool = True) -> list[int]:
    """Row order of one epoch (a seeded permutation per epoch)."""
    order = list(range(n))
    if shuffle:
        random.Random(seed * 1_000_033 + epoch).shuffle(order)
    return order


class PromptStream:
    """Prompts in training order, addressed by a global position (position p is row
    order(p // n)[p % n]); the controller checkpoints only the position."""

    def __init__(self, rows: list[PromptRow], seed: int, shuffle: bool = True):
        if not rows:
            raise ValueError("the training set is empty")
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self._cache: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def at(self, position: int) -> PromptRow:
        epoch, i = divmod(position, len(self.rows))
        order = self._cache.get(epoch)
        if order is None:
            self._cache = {epoch: epoch_order(len(self.rows), epoch, self.seed, self.shuffle)}
            order = self._cache[epoch]
        return self.rows[order[i]]
