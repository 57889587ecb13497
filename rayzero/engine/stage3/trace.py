"""The recorded order in which stage-3 modules fetch their parameters (pure logic, no torch).

[Note: stage-3 prefetch order]
Stage 3 cannot know which module runs next until it runs, so the first micro-step *records* the
sequence of fetch events — one per module forward, one per module backward, each naming the
parameters it needs (`ModuleTrace.observe` while recording). From the next micro-step on, the
trace is *replayed*: each fetch advances a cursor, and the coordinator (hooks.py) uses
  - `upcoming()` to issue all-gathers for the next events' parameters ahead of time, up to
    `prefetch_bucket_size` elements (and never beyond `max_live_parameters` gathered at once);
  - `reuse_distance()` to keep a parameter gathered when its next use is fewer than
    `max_reuse_distance` fetched elements away instead of releasing and re-gathering it.
If a fetch does not match the trace (data-dependent control flow, eval vs train), the trace is
dropped and recording starts again from that point; prefetching pauses until it is complete.
Every rank runs the same model on same-shaped batches, so every rank makes the same decisions
and issues the same collectives in the same order — the invariant gloo and NCCL need.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class FetchEvent:
    """A module needs its parameters: `key` identifies module and pass, `params` the entries."""

    key: tuple[int, str]
    """(module index, "forward" | "backward")."""
    params: tuple[int, ...]
    """Indices of the partitioned parameters the module fetches."""


class ModuleTrace:
    """Records fetch events on the first micro-step, then replays them with a cursor."""

    def __init__(self, numel_of: Callable[[int], int]) -> None:
        self._numel_of = numel_of
        self.events: list[FetchEvent] = []
        """The completed trace (empty until one full micro-step was recorded)."""
        self._recording: list[FetchEvent] = []
        self.recording = True
        self.cursor = 0
        """Index of the next expected event while replaying."""
        self._positions: dict[int, list[int]] = {}
        self._prefix_numel: list[int] = [0]
        self.invalidations = 0

    @property
    def complete(self) -> bool:
        return not self.recording and bool(self.events)

    def begin_micro_step(self) -> None:
        """A new forward starts: a finished recording becomes the trace; replay from the start."""
        if self.recording and self._recording:
            self._install(self._recording)
            self._recording = []
            self.recording = False
        self.cursor = 0

    def expected(self) -> FetchEvent | None:
        """The event the trace expects next (None while recording or past its end)."""
        if self.recording or self.cursor >= len(self.events):
            return None
        return self.events[self.cursor]

    def observe(self, event: FetchEvent) -> bool:
        """Note that `event` happened; True if it matched the trace (cursor advanced)."""
        if self.recording:
            self._recording.append(event)
            return False
        if self.cursor < len(self.events) and self.events[self.cursor] == event:
            self.cursor += 1
            return True
        # Diverged: record afresh from the start of this micro-step's known prefix.
        self.invalidations += 1
        self._recording = list(self.events[: self.cursor]) + [event]
        self.events = []
        self.recording = True
        return False

    def upcoming(self) -> Iterator[FetchEvent]:
        """Events expected after the current one (nothing while recording)."""
        if self.recording:
            return iter(())
        return iter(self.events[self.cursor:])

    def reuse_distance(self, param: int) -> int | None:
        """Elements fetched by the events between now and `param`'s next use; None if none."""
        if self.recording:
            return None
        positions = self._positions.get(param, [])
        next_index = bisect.bisect_left(positions, self.cursor)
        if next_index == len(positions):
            return None
        use = positions[next_index]
        return self._prefix_numel[use] - self._prefix_numel[self.cursor]

    def _install(self, events: list[FetchEvent]) -> None:
        self.events = events
        self._positions = {}
        self._prefix_numel = [0]
        for index, event in enumerate(events):
            for param in event.params:
                self._positions.setdefault(param, []).append(index)
            self._prefix_numel.append(self._prefix_numel[-1] + sum(self._numel_of(p) for p in event.params))
