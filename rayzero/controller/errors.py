"""Errors the controller hands to the driver. All survive pickling (see rayzero.workers.errors)."""
from __future__ import annotations

from rayzero.workers.errors import RayZeroRuntimeError


class TrainingFailedError(RayZeroRuntimeError):
    """The run ended because a worker failed. `rank` is the failing rank (None if not one rank)."""

    def __init__(self, message: str, rank: int | None = None, traceback_text: str = "") -> None:
        super().__init__(message, rank, traceback_text)
        self.rank = rank
        self.traceback_text = traceback_text


class ResourcesUnavailableError(TrainingFailedError):
    """The placement group for the workers could not be scheduled within the wait allowed."""

    def __init__(self, message: str) -> None:
        super().__init__(message, None, "")

    def __reduce__(self):
        return (type(self), (self.message,))
