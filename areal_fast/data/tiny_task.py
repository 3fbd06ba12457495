"""The shipped tiny task: reverse a random string, with a long-tailed length distribution.

    prompt  "cabjd="   ->   answer  "djbac"   (then <eos>)

Why this task: it is verifiable exactly, a 300k-parameter Qwen2 learns it on one CPU core in
minutes, and its answer length (= the input length) follows a log-normal tail
(len = min_len + floor(exp(N(mu, sigma))), cut at max_len): with the defaults the median is
4 characters and the longest 1 % are >= 17, so a synchronous batch waits for its few long
samples while an asynchronous run keeps generating. That is exactly the regime where AReaL's
asynchrony pays off.

With ``data.synthetic.growth`` (:class:`LengthGrowthConfig`) the strings lengthen over the run, as a
long-CoT run's answers do: the centre of the length distribution (mu) moves from ``log_mean`` to
``growth.end_log_mean`` along the training order (:func:`progress_of`), the held-out rows spread evenly
over the same range, and the warm start's demonstrations are drawn over all of it.

The reward (:func:`reward`) is importable by name (``areal_fast.data.tiny_task:reward``) so the
reward service can run it in its worker processes.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from areal_fast.configutil import check_rules, finite_number, option

SEPARATOR = "="
TRAIN_SEED_OFFSET = 0
EVAL_SEED_OFFSET = 1_000_003  # a different stream for the held-out split


@dataclass(kw_only=True, slots=True)
class LengthGrowthConfig:
    """Strings (and so answers) that lengthen over the run, as a long-CoT run's answers do: the
    centre of the log-normal length distribution moves linearly from ``data.synthetic.log_mean`` to
    ``end_log_mean`` along the training order. Needs ``data.shuffle: false`` (the order is the schedule)."""

    rows: int = option(0, ge=0)
    """Training rows over which the centre moves (row i of the training order is at fraction
    i / rows of the way; later rows stay at the end). A run of S steps takes about S x
    ``train.batch_size`` rows. 0 = off: the lengths do not change."""
    end_log_mean: float = 2.0
    """mu of the log-normal part of the length at the end of the growth (the start is ``log_mean``)."""

    def __post_init__(self):
        check_rules(self)
        if not finite_number(self.end_log_mean):
            raise ValueError(f"end_log_mean: must be a finite number, got {self.end_log_mean!r}")


@dataclass(kw_only=True, slots=True)
class SyntheticTaskConfig:
    """The procedurally generated reversal task (``areal_fast.data.tiny_task``)."""

    alphabet: str = "abcdefghij"
    """Characters of the strings to reverse (distinct, without the separator '=')."""
    min_len: int = 2
    """Shortest string."""
    max_len: int = 24
    """Longest string (the tail of the log-normal length distribution is cut here)."""
    log_mean: float = 1.0
    """mu of the log-normal part of the length: len = min_len + floor(exp(N(mu, sigma)))."""
    log_std: float = option(0.75, ge=0)
    """sigma of the log-normal part of the length (larger = longer tail)."""
    n_train: int = option(20000, ge=1)
    """Training prompts (the order is a seeded permutation; the run cycles through it)."""
    n_eval: int = option(128, ge=0)
    """Held-out prompts (a disjoint seed)."""
    growth: LengthGrowthConfig = field(default_factory=LengthGrowthConfig)
    """Lengths that grow over the run (off by default)."""

    def __post_init__(self):
        check_rules(self)
        if len(set(self.alphabet)) != len(self.alphabet) or not self.alphabet:
            raise ValueError(f"alphabet: must be non-empty distinct characters, got {self.alphabet!r}")
        if SEPARATOR in self.alphabet:
            raise ValueError(f"alphabet: must not contain the separator {SEPARATOR!r}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"min_len/max_len: need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        g = self.growth
        if g.rows:
            if g.rows > self.n_train:
                raise ValueError(f"growth.rows: must be at most n_train ({self.n_train}): the run cycles through "
                                 f"the training rows, got {g.rows}")
            if self.min_len + math.exp(min(g.end_log_mean, 700.0)) > self.max_len:  # 700: exp stays finite
                raise ValueError(f"growth.end_log_mean: the median length at the end, min_len + exp(mu), is above "
                                 f"max_len ({self.max_len}): most strings would be cut there, got {g.end_log_mean}")


def centre(cfg: SyntheticTaskConfig, progress: float) -> float:
    """mu of the log-normal part of the length at ``progress`` (0: the start, 1: the end of the growth)."""
    if not cfg.growth.rows:
        return cfg.log_mean
    p = min(max(progress, 0.0), 1.0)
    return cfg.log_mean + p * (cfg.growth.end_log_mean - cfg.log_mean)


def median_length(cfg: SyntheticTaskConfig, progress: float = 0.0) -> float:
    """The median string length at ``progress`` (before the floor: min_len + exp(mu), cut at max_len)."""
    return min(cfg.min_len + math.exp(centre(cfg, progress)), cfg.max_len)


def progress_of(cfg: SyntheticTaskConfig, split: str, i: int) -> float:
    """Where row ``i`` of a split sits in the growth: a training row at i / ``growth.rows`` (1 past it),
    a held-out row evenly over the whole range (i / (n_eval - 1)), so the held-out exact match weighs
    every length of the run alike."""
    if not cfg.growth.rows:
        return 0.0
    if split == "train":
        return min(i / cfg.growth.rows, 1.0)
    return i / (cfg.n_eval - 1) if cfg.n_eval > 1 else 0.0


def sample_length(rng: random.Random, cfg: SyntheticTaskConfig, progress: float = 0.0) -> int:
    extra = int(math.exp(rng.gauss(centre(cfg, progress), cfg.log_std)))
    return min(cfg.min_len + extra, cfg.max_len)


def make_row(rng: random.Random, cfg: SyntheticTaskConfig, progress: float | None = None) -> dict:
    """A row at ``progress`` of the growth; None: anywhere in it (uniform, drawn from ``rng``: the warm
    start's demonstrations cover the whole range). Without growth the progress changes nothing."""
    if progress is None:
        progress = rng.random() if cfg.growth.rows else 0.0
    s = "".join(rng.choice(cfg.alphabet) for _ in range(sample_length(rng, cfg, progress)))
    return {"prompt": s + SEPARATOR, "answer": s[::-1]}


def generate(cfg: SyntheticTaskConfig, split: str, seed: int) -> list[dict]:
    """Rows {'prompt','answer'} of 'train' (n_train) or 'eval' (n_eval); deterministic in seed."""
    if split not in ("train", "eval"):
        raise ValueError(f"tiny_task.generate: split must be 'train' or 'eval', got {split!r}")
    n = cfg.n_train if split == "train" else cfg.n_eval
    rng = random.Random(seed * 7919 + (TRAIN_SEED_OFFSET if split == "train" else EVAL_SEED_OFFSET))
    return [make_row(rng, cfg, progress_of(cfg, split, i)) for i in range(n)]


def vocabulary(cfg: SyntheticTaskConfig) -> str:
    """Characters of the character-level tokenizer (alphabet + separator)."""
    return cfg.alphabet + SEPARATOR


def _answer_of(task) -> str:
    if isinstance(task, dict):
        for k in ("answer", "solution", "label"):
            if k in task:
                return str(task[k])
        raise ValueError(f"tiny_task.reward: task has no 'answer' field (keys: {sorted(task)})")
    return str(task)


def reward(task, completion: str) -> float:
    """1.0 when the completion (special tokens removed) is exactly the reversed string, else 0.0."""
    return 1.0 if completion.strip() == _answer_of(task) else 0.0


def char_accuracy(task, completion: str) -> float:
    """Fraction of answer positions the completion gets right (a diagnostic, not the reward)."""
    ans = _answer_of(task)
    if not ans:
        return float(completion.strip() == "")
    got = completion.strip()
    return sum(a == b for a, b in zip(ans, got)) / max(len(ans), len(got))


def partial_reward(task, completion: str) -> float:
    """Dense variant: the fraction of answer positions that are right (1.0 only for the exact
    answer; a wrong length costs the extra or missing positions). Gives a gradient on long strings,
    where exact answers are rare."""
    return char_accuracy(task, completion)
