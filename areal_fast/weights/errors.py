"""The error of every weight-sync transport (torch-free, below ``group`` and ``sync``)."""

from __future__ import annotations

__all__ = ["WeightSyncError"]


class WeightSyncError(RuntimeError):
    """A weight update failed; the message names the server, endpoint and tensors involved.

    ``status``: the HTTP status when the server answered one (None: no answer, or success=false)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status
