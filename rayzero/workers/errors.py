"""Exceptions that cross actor boundaries (worker -> controller -> driver).

Every one of them derives from `RayZeroRuntimeError` ([Note: user-facing errors] in
rayzero/config/errors.py) and rebuilds itself from its constructor arguments when unpickled
(`__reduce__`), so a subclass with extra fields arrives on the driver with those fields intact
instead of failing inside Ray's deserializer.
"""
from __future__ import annotations

from rayzero.config.errors import RayZeroRuntimeError

__all__ = ["RayZeroRuntimeError", "WorkerSetupError"]


class WorkerSetupError(RayZeroRuntimeError):
    """A worker could not be prepared (environment, process group) before the loop started."""

    def __init__(self, message: str, rank: int, traceback_text: str = "") -> None:
        super().__init__(message, rank, traceback_text)
        self.rank = rank
        self.traceback_text = traceback_text
