"""Requests from the control plane to the controller's step loop, and how callers wait on them.

See [Note: the control seam] in status.py: a request is recorded here by the calling thread and
carried out by `Controller.step()`; the caller waits (bounded) on `ControlRequest.wait`.
"""
from __future__ import annotations

import enum
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

from rayzero.config.errors import RayZeroRuntimeError


class RequestKind(enum.Enum):
    CHECKPOINT = "checkpoint"
    STOP = "stop"
    SCALE = "scale"
    KILL = "kill"


_IDS = itertools.count(1)  # request ids: the workers' boundary agreement keeps the largest


@dataclass
class ControlRequest:
    kind: RequestKind
    workers: int = 0
    """SCALE: the target size."""
    reason: str = ""
    request_id: int = field(default_factory=lambda: next(_IDS))
    result: Any = None
    error: BaseException | None = None
    _done: threading.Event = field(default_factory=threading.Event)

    def resolve(self, result: Any = None) -> None:
        self.result = result
        self._done.set()

    def reject(self, error: BaseException) -> None:
        self.error = error
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> Any:
        """The outcome, or RayZeroRuntimeError after `timeout_s` (the request stays in effect)."""
        if not self._done.wait(timeout_s):
            raise RayZeroRuntimeError(f"{self.kind.value} did not complete within {timeout_s:g}s; the run "
                                      "goes on (raise the timeout, or check `rayzero status`)")
        if self.error is not None:
            raise self.error
        return self.result
