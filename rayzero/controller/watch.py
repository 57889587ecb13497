"""What the controller watches while a group runs: heartbeats (hangs, stragglers, checkpoints the
ranks committed), Ray's drain notices, and room to grow back. A mixin of `Controller`, as
`PlannedStops` is: it shares the controller's state and group and changes state only through the
controller's own transitions ([Note: states that carry their data] in states.py).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from rayzero.controller.errors import first_to_blame
from rayzero.controller.failures import Failure, FailureKind
from rayzero.controller.health import Straggler, find_hang, slow_ranks, stacks_text
from rayzero.controller.requests import ControlRequest, RequestKind
from rayzero.controller.states import Running

if TYPE_CHECKING:
    from collections.abc import Callable

    from rayzero.controller.committed_checkpoints import CheckpointTracker
    from rayzero.controller.controller import ControllerSettings
    from rayzero.controller.elastic import BatchPlan
    from rayzero.controller.goodput import Goodput
    from rayzero.controller.interval import CheckpointInterval
    from rayzero.controller.states import ControllerState
    from rayzero.controller.worker_group import WorkerGroup
    from rayzero.workers.boundary import Heartbeat

logger = logging.getLogger("rayzero.controller")

MAX_STRAGGLERS_KEPT = 1000  # every update carries the list: the newest this many


class Watch:
    """The watching half of `Controller` (a mixin)."""

    # Set by Controller.__init__; listed here for the reader and the type checker.
    attempt: int
    world_size: int
    heartbeats: dict[int, Heartbeat | None]
    heard_at: dict[int, float]
    heartbeat_rounds: int
    stragglers: list[Straggler]
    checkpoints: CheckpointTracker
    _state: ControllerState
    _group: WorkerGroup | None
    _plan: BatchPlan
    _settings: ControllerSettings
    _slow_rounds: dict[int, int]
    _next_checkpoint_scan: float
    _next_grow_check: float
    _size_cap: int | None
    _goodput_checkpoint: int | None
    goodput: Goodput
    interval: CheckpointInterval
    failures: int
    _interval_request: ControlRequest | None
    _attempt_started_at: float
    _capacity: Callable[[], int | None]
    _draining: Callable[[], set[str]]
    # The controller's methods this half calls (defined by Controller and PlannedStops).
    _event: Callable[[str], None]
    _on_failure: Callable[[Failure], None]
    _progress_awaiting: Callable[[], None]
    _begin_planned: Callable[[ControlRequest], None]
    submit: Callable[[ControlRequest], ControlRequest]
    _smallest: Callable[[], int]

    def _check_heartbeats(self, now: float) -> bool:
        """Take a round of heartbeats; False when it ended the attempt (a failure)."""
        assert self._group is not None
        beats, failures = self._group.heartbeats(min(2.0, self._settings.heartbeat_interval_s + 1.0))
        if failures:
            self._on_failure(first_to_blame(failures))
            return False
        for rank, beat in beats.items():
            if beat is not None:
                self.heard_at[rank] = now
                self.heartbeats[rank] = beat
                self.checkpoints.note_heartbeat(beat.committed)
        self.heartbeat_rounds += 1
        if now >= self._next_checkpoint_scan:
            self._next_checkpoint_scan = now + self._settings.checkpoint_scan_interval_s
            self.checkpoints.refresh()
        self._tell_goodput(now)
        self._progress_awaiting()
        self._maybe_checkpoint()
        self._watch_stragglers()
        if isinstance(self._state, Running):
            self._check_drain()
        silent = {rank: now - since for rank, since in self.heard_at.items()}
        hang = find_hang({rank: self.heartbeats.get(rank) for rank in range(self.world_size)}, silent,
                         self._settings.hang)
        if hang is None:
            return True
        stacks = self._group.stacks(5.0)
        message = hang.reason + "\n\n" + stacks_text(stacks, hang.culprit)  # the hung rank first
        self._event(f"hang detected: {message}")
        self._on_failure(Failure(FailureKind.HANG, message, hang.culprit, stacks.get(hang.culprit, "")))
        return False

    def _tell_goodput(self, now: float) -> None:
        """Checkpoints committed and the ranks' save stalls, for [Note: goodput accounting]."""
        latest = self.checkpoints.latest
        if latest is not None and latest.step != self._goodput_checkpoint:
            self._goodput_checkpoint = latest.step
            self.goodput.checkpointed(latest.step)
        first = self.heartbeats.get(0)
        if first is not None and first.stepped:  # a loop that makes no reports still shows its steps
            self.goodput.engine_stepped(first.step, time.time())
        stalls = [beat.save_stall_s for beat in self.heartbeats.values() if beat is not None]
        if stalls:
            self.interval.saved(self.goodput.save_stalled(max(stalls), time.time()))

    def nodes(self) -> int:
        """Nodes the current group runs on (from the heartbeats; at least 1)."""
        return max(1, len({beat.node_id for beat in self.heartbeats.values() if beat is not None}))

    def _maybe_checkpoint(self) -> None:
        """Ask for a checkpoint when the interval has passed ([Note: a checkpoint interval from the numbers])."""
        if not self.interval.active or not isinstance(self._state, Running):
            return
        if self._interval_request is not None and not self._interval_request.done:
            return  # the one asked for is still on its way
        snapshot = self.goodput.snapshot(time.time())
        interval = self.interval.seconds(self.nodes(), self.failures, snapshot["wall_s"])
        latest = self.checkpoints.latest
        since = max(latest.time if latest is not None else 0.0, self._attempt_started_at)
        if interval is not None and time.time() - since >= interval:
            self._interval_request = ControlRequest(RequestKind.CHECKPOINT, reason="interval")
            self.submit(self._interval_request)

    def _watch_stragglers(self) -> None:
        """Report a rank slow in `rounds` heartbeat rounds in a row, once per streak ([Note: stragglers])."""
        policy = self._settings.stragglers
        slow = slow_ranks({rank: self.heartbeats.get(rank) for rank in range(self.world_size)}, policy)
        self._slow_rounds = {rank: self._slow_rounds.get(rank, 0) + 1 for rank in slow}
        for rank, (own, median, step_time) in sorted(slow.items()):
            beat = self.heartbeats.get(rank)
            if self._slow_rounds[rank] == policy.rounds and beat is not None:
                found = Straggler(rank, beat.node_id, self.attempt, own, median, step_time)
                self.stragglers = [*self.stragglers[-(MAX_STRAGGLERS_KEPT - 1):], found]
                self._event(found.describe())

    def _check_drain(self) -> None:
        """Ray's node drain notice (a preemption with a deadline) on a node a rank runs on: checkpoint
        at the agreed boundary and regroup without it, before the node goes (no budget used)."""
        try:
            draining = self._draining()
        except Exception as error:  # noqa: BLE001 - a failed probe must not end the run
            logger.debug("drain probe failed: %s", error)
            return
        hit = {rank for rank, beat in self.heartbeats.items()
               if beat is not None and rank < self.world_size and beat.node_id in draining}
        if not hit:
            return
        target = self._plan.choose(self.world_size - len(hit)) or self._smallest()
        self._event(f"node(s) of rank(s) {sorted(hit)} are draining: checkpointing, then regrouping with {target}")
        self._begin_planned(ControlRequest(RequestKind.SCALE, workers=target, reason="drain"))

    def _maybe_grow(self, now: float) -> None:
        ceiling = min(self._plan.max_workers, self._size_cap or self._plan.max_workers)
        if now < self._next_grow_check or self.world_size >= ceiling:
            return
        self._next_grow_check = now + self._settings.grow_interval_s
        free = self._capacity()
        if free is None:
            return
        target = self._plan.choose(min(ceiling, self.world_size + free))
        if target is not None and target > self.world_size:
            self._event(f"room for {target} worker(s) (now {self.world_size}): growing through a planned resize")
            self._begin_planned(ControlRequest(RequestKind.SCALE, workers=target, reason="grow"))
