"""Ctrl-C and SIGTERM on the driver are a planned stop, not an abort.

[Note: driver signals]
`rayzero.fit` (and `rayzero run`, `ray job stop`, a Kubernetes pod being deleted) may be told to end
by SIGINT or SIGTERM. The first one asks the controller for a planned stop: every rank saves at the
next step boundary they all reach, the commit finishes, the loops end, and `fit` returns a Result
with `stopped=True` (`rayzero run` exits 0 saying where the checkpoint is). A second signal kills
the run at once without a checkpoint. The handlers only set a flag; the driver's streaming loop
(which wakes at least once a second) acts on it, so no Ray call runs inside a signal handler.
Handlers are installed only on the main thread (Python allows no other) and restored afterwards.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Self


class StopSignals:
    """Counts SIGINT/SIGTERM received while installed (a context manager)."""

    def __init__(self) -> None:
        self.count = 0  # signals received so far
        self.acted = 0  # how many of them the driver has acted on
        self.name = ""  # the newest signal's name, for the driver's line
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        self.name = signal.Signals(signum).name

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def take(self) -> int:
        """0 when nothing new arrived, else the number of the signal (1 = first: stop; 2+ = kill)."""
        if self.acted >= self.count:
            return 0
        self.acted = self.count
        return self.count
