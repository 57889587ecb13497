"""Errors the controller hands to the driver. All survive pickling (see rayzero.workers.errors)."""
from __future__ import annotations

from rayzero.controller.failures import Failure, FailureKind
from rayzero.workers.errors import RayZeroRuntimeError


class TrainingFailedError(RayZeroRuntimeError):
    """The run ended because a worker failed. `rank` is the failing rank (None if not one rank);
    `exit_code` the exit status of a script that ended with one (`rayzero run` exits with it)."""

    def __init__(self, message: str, rank: int | None = None, traceback_text: str = "",
                 exit_code: int | None = None) -> None:
        super().__init__(message, rank, traceback_text, exit_code)
        self.rank = rank
        self.traceback_text = traceback_text
        self.exit_code = exit_code


class ResourcesUnavailableError(TrainingFailedError):
    """The placement group for the workers could not be scheduled within the wait allowed."""

    def __init__(self, message: str) -> None:
        super().__init__(message, None, "")

    def __reduce__(self):
        return (type(self), (self.message,))


def first_to_blame(failures: list[Failure]) -> Failure:
    # A loop error names its cause; a rank that died afterwards was usually killed by it.
    order = [FailureKind.LOOP_ERROR, FailureKind.HANG, FailureKind.SETUP_ERROR, FailureKind.WORKER_DIED,
             FailureKind.SCHEDULING]
    return min(failures, key=lambda f: (order.index(f.kind), f.rank if f.rank is not None else 1 << 30))


def training_failed(failure: Failure, what_next: str = "") -> TrainingFailedError:
    """The error a run ends with; `what_next`: why no further restart, and how to resume."""
    if failure.kind is FailureKind.SCHEDULING:
        return ResourcesUnavailableError(failure.message + (f"\n{what_next}" if what_next else ""))
    where = f"rank {failure.rank}" if failure.rank is not None else "the worker group"
    message = f"training failed on {where}: {failure.message}" + (f"\n{what_next}" if what_next else "")
    if failure.traceback_text and failure.kind is not FailureKind.HANG:
        message += f"\n\n--- traceback from {where} ---\n{failure.traceback_text.rstrip()}"
    return TrainingFailedError(message, failure.rank, failure.traceback_text, failure.exit_code)
