"""Prompt datasets: the synthetic task, local JSONL / Parquet files, Hugging Face `datasets`.

A dataset is a list of :class:`PromptRow` (index, text, task). ``task`` is what the reward
function receives: every field of the row except the prompt, with the answer field named
'answer' and the tests field named 'tests' (so a code task keeps 'fn_name', 'time_limit_s',
'memory_mb', 'partial', and any row may carry its own 'reward' or 'timeout_s'). The training
order is a seeded permutation, cycled epoch after epoch, so the controller's data position
(one integer) says exactly which prompts were already taken.

Every problem with a file is an error that names the file (and the line for JSONL).
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

from areal_fast.data.config import FILE_SUFFIXES, SYNTHETIC_TASKS, DataConfig, check_source

__all__ = ["FILE_SUFFIXES", "SYNTHETIC_TASKS", "PromptRow", "build_prompts", "check_source", "load_split",
           "read_rows", "task_of"]


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
    opener = gzip.open if path.name.endswith(".gz") else open
    n = 0
    try:
        with opener(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8").strip()
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                                     f"{e.start + 1})") from None
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{n}: a row must be a JSON object with named fields, got "
                                     f"{type(row).__name__} {line[:40]!r}")
                rows.append(row)
    except (gzip.BadGzipFile, EOFError) as e:
        where = f" after line {n}" if n else ""
        raise ValueError(f"{path}: not a readable gzip file{where} ({e})") from None
    return rows


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {path} needs pyarrow (`pip install pyarrow`)") from e
    try:
        return pq.read_table(str(path)).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise ValueError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None


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
    """Raw rows of a source ('synthetic:reverse', *.jsonl, *.jsonl.gz, *.parquet, 'hf:NAME[:CONFIG]');
    every row is a dict."""
    check_source(source)
    if source.startswith("synthetic:"):
        from areal_fast.data import tiny_task

        return tiny_task.generate(cfg.synthetic, "train" if split == "train" else "eval", seed)
    if source.startswith("hf:"):
        return _read_hf(source, cfg.split if split == "train" else cfg.eval_split)
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"data file {source!r} does not exist")
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return _read_jsonl(path)
    return _read_parquet(path)


def build_prompts(rows: list[dict], cfg: DataConfig, tokenizer=None, source: str = "") -> list[PromptRow]:
    """Apply the template (and chat template) and pick the task fields; a missing prompt field is
    an error naming the row and the key."""
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{source or 'data'} row {i}: a row must be a mapping of fields, got "
                             f"{type(row).__name__} {row!r:.40}")
        if cfg.prompt_key not in row:
            raise KeyError(f"{source or 'data'} row {i}: no field {cfg.prompt_key!r} (data.prompt_key); "
                           f"fields: {sorted(row)}")
        prompt = row[cfg.prompt_key]
        if not isinstance(prompt, str):
            raise ValueError(f"{source or 'data'} row {i}: field {cfg.prompt_key!r} (data.prompt_key) must be "
                             f"text, got {type(prompt).__name__}")
        text = cfg.prompt_template.format(prompt=prompt)
        if cfg.chat_template and tokenizer is not None:
            text = tokenizer.apply_chat_template(text)
        task = task_of(row, cfg)
        if "answer" not in task and "tests" not in task:
            raise KeyError(f"{source or 'data'} row {i}: neither {cfg.answer_key!r} (data.answer_key) nor "
                           f"{cfg.tests_key!r} (data.tests_key) is present")
        out.append(PromptRow(index=i, text=text, task=task))
    return out


def task_of(row: dict, cfg: DataConfig) -> dict:
    """What the reward receives for ``row``: every field but the prompt, the configured answer and
    tests fields under the names the rewards read ('answer', 'tests')."""
    renamed = {cfg.answer_key: "answer", cfg.tests_key: "tests"}
    task = {}
    for k, v in row.items():
        if k == cfg.prompt_key:
            continue
        name = renamed.get(k, k)
        if name in task and k not in renamed:
            continue  # the configured field wins over a stray one of the same target name
        task[name] = v
    return task


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
