"""Exceptions that cross actor boundaries (worker -> controller -> driver).

Every one of them derives from `RayZeroRuntimeError` and rebuilds itself from its constructor
arguments when unpickled (`__reduce__`), so a subclass with extra fields arrives on the driver with
those fields intact instead of failing inside Ray's deserializer.
"""
from __future__ import annotations

from typing import Any


class RayZeroRuntimeError(RuntimeError):
    """Base of every error raised by the rayzero runtime (driver, controller, workers)."""

    def __init__(self, message: str, *args: Any) -> None:
        super().__init__(message, *args)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return (type(self), self.args)


class WorkerSetupError(RayZeroRuntimeError):
    """A worker could not be prepared (environment, process group) before the loop started."""

    def __init__(self, message: str, rank: int, traceback_text: str = "") -> None:
        super().__init__(message, rank, traceback_text)
        self.rank = rank
        self.traceback_text = traceback_text
