"""The chaos benchmark's reward (``bench/bench_chaos.py``): the tiny task's partial reward, which hangs
(sleeps for good) on about one row in ``HANG_ONE_IN`` while the file named by ``$CHAOS_HANG_FILE``
holds a wall-clock time in the future. The reward service must end each such call at
``reward.timeout``, kill its worker and score the row 0 (``docs/deadlines.md``).

It runs in the reward workers as ``bench.chaos_reward:reward``; they inherit the run's environment
(the bench puts the repository root on ``PYTHONPATH``)."""

from __future__ import annotations

import os
import time
import zlib

from areal_fast.data.tiny_task import partial_reward

HANG_FILE_ENV = "CHAOS_HANG_FILE"
HANG_ONE_IN = 3


def hanging(completion: str, now: float | None = None) -> bool:
    """Whether this call should hang now: the hang window is open and the row is one of the chosen."""
    path = os.environ.get(HANG_FILE_ENV)
    if not path:
        return False
    try:
        with open(path) as f:
            until = float(f.read().strip() or 0)
    except (OSError, ValueError):
        return False
    now = time.time() if now is None else now
    return now < until and zlib.crc32(completion.encode()) % HANG_ONE_IN == 0


def reward(task, completion: str) -> float:
    if hanging(completion):
        while True:  # a reward that never returns (a stuck verifier): only a kill ends it
            time.sleep(3600)
    return partial_reward(task, completion)
