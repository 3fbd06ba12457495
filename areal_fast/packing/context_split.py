"""The context-parallel cut of one packed micro-batch: ``cp`` ranks take equal contiguous shares.

A packed row holds sequences end to end (``cu_seqlens``). Under context parallelism every rank of a
group packs the same micro-batch and keeps ``1 / cp`` of its tokens: rank ``r`` the rows
``[r * n, (r + 1) * n)`` of the row padded to ``cp * n`` tokens (``n = ceil(T / cp)``). The padding
(fewer than ``cp`` tokens) is one extra sequence at the end, which attends only to itself and is out
of the loss. A sequence may straddle a cut, and one sequence may span several ranks' shares: the cut
is by tokens, never by sequences, so a rank's share is the same size whatever the lengths.

Two sets of boundaries come out: those of the whole padded row (the attention's: after the
all-to-all each rank sees every token of its heads) and those of each share (the pieces of sequences
a rank holds: what its per-token loss and statistics are computed over). Plain integers; the trainer
turns them into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from areal_fast.packing.plan import as_lengths


@dataclass(frozen=True)
class ContextSplit:
    """The cut of one packed row of ``tokens`` real tokens over ``cp`` ranks."""

    cp: int
    tokens: int
    """Real tokens of the row (the sum of the lengths)."""
    share: int
    """Tokens per rank, padding included: ``ceil(tokens / cp)``."""
    cu_seqlens: np.ndarray
    """int64 [S+1] (+1 with padding): the padded row's sequences, the padding last."""

    @property
    def padded(self) -> int:
        return self.share * self.cp

    @property
    def pad(self) -> int:
        return self.padded - self.tokens

    @property
    def max_seqlen(self) -> int:
        return int(np.diff(self.cu_seqlens).max())

    def bounds(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s rows ``[lo, hi)`` of the padded row."""
        if not 0 <= rank < self.cp:
            raise ValueError(f"context split: rank {rank} outside 0..{self.cp - 1}")
        return rank * self.share, (rank + 1) * self.share

    def local_cu_seqlens(self, rank: int) -> np.ndarray:
        """int64: the pieces of sequences rank ``rank`` holds, as boundaries of its share (0 .. share)."""
        lo, hi = self.bounds(rank)
        inner = self.cu_seqlens[(self.cu_seqlens > lo) & (self.cu_seqlens < hi)] - lo
        return np.concatenate([[0], inner, [hi - lo]]).astype(np.int64)


def context_split(lengths, cp: int) -> ContextSplit:
    """Cut a packed row of sequences of ``lengths`` into ``cp`` equal contiguous shares (see the module
    docstring). ``cp`` 1 is the row as it is."""
    arr = as_lengths(lengths)
    if cp < 1:
        raise ValueError(f"context split: cp must be >= 1, got {cp}")
    if not arr.size or (arr <= 0).any():
        raise ValueError(f"context split: every sequence needs at least one token, got lengths {arr.tolist()[:8]}")
    tokens = int(arr.sum())
    share = -(-tokens // cp)
    cu = np.zeros(arr.size + 1, dtype=np.int64)
    np.cumsum(arr, out=cu[1:])
    if share * cp > tokens:
        cu = np.append(cu, share * cp)
    return ContextSplit(cp=cp, tokens=tokens, share=share, cu_seqlens=cu)
