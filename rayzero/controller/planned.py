"""Planned stops, resizes and `checkpoint now`: the control-plane requests the controller carries out.

[Note: the control seam] in status.py says where requests come from; [Note: agreed step boundary]
in rayzero/workers/boundary.py how the ranks save at one step. Requests are recorded from any
thread (`submit`) and taken by the step loop only (`_take_requests`), so the state machine never
changes state outside `Controller.step()`. A STOP moves Running to Draining, a SCALE to Resizing
([Note: states that carry their data] in states.py: the request and its deadline travel with them);
both wait for the boundary checkpoint ([Note: one retry budget]: neither is charged as a failure).
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from rayzero.config.errors import RayZeroRuntimeError
from rayzero.controller.failures import Failure, FailureKind
from rayzero.controller.requests import ControlRequest, RequestKind
from rayzero.controller.states import (
    ControllerState,
    Event,
    ResizePlanned,
    Resizing,
    Running,
    RunState,
    StoppedIdle,
    StopPlanned,
)
from rayzero.workers.boundary import BoundaryRequest

if TYPE_CHECKING:
    from collections.abc import Callable

    from rayzero.controller.committed_checkpoints import CheckpointTracker
    from rayzero.controller.controller import ControllerSettings
    from rayzero.controller.elastic import BatchPlan
    from rayzero.controller.goodput import Goodput
    from rayzero.controller.worker_group import WorkerGroup
    from rayzero.workers.boundary import Heartbeat


class PlannedStops:
    """The request half of `Controller` (a mixin: it shares the controller's state and group)."""

    # Set by Controller.__init__; listed here for the reader and the type checker.
    state: RunState
    world_size: int
    heartbeats: dict[int, Heartbeat | None]
    checkpoints: CheckpointTracker
    _state: ControllerState
    _group: WorkerGroup | None
    _plan: BatchPlan
    _settings: ControllerSettings
    _lock: threading.Lock
    _requests: list[ControlRequest]  # recorded, not yet taken by step()
    _awaiting: list[ControlRequest]  # sent to the workers, waiting for the boundary
    _size_cap: int | None
    _clock: Callable[[], float]
    goodput: Goodput
    # The controller's methods this half calls (defined by Controller).
    _event: Callable[[str], None]
    _end_errored: Callable[..., None]  # (failure, why="", killed=False)
    _move: Callable[[Event], None]

    # ---- requests ([Note: the control seam]) -----------------------------------------------
    def submit(self, request: ControlRequest) -> ControlRequest:
        """Record a request for the step loop (any thread); wait on it with `request.wait`."""
        if request.kind is RequestKind.SCALE:
            self._plan.check(request.workers)
        with self._lock:
            self._requests.append(request)
        return request

    def _take_requests(self) -> None:
        with self._lock:
            requests, self._requests = self._requests, []
        for request in requests:
            if request.kind is RequestKind.KILL:
                self._event(f"killed: {request.reason}")
                if not self.state.is_terminal:
                    self._end_errored(Failure(FailureKind.LOOP_ERROR, f"the run was killed: {request.reason}"),
                                      killed=True)
                request.resolve(None)
            elif self.state.is_terminal:
                self._settle(request)
            elif request.kind is RequestKind.CHECKPOINT:
                if not isinstance(self._state, Running):
                    request.reject(RayZeroRuntimeError(f"cannot checkpoint now: the run is {self.state.value}, "
                                                       "not running; try again once it runs"))
                    continue
                self._group.request_boundary(request.request_id, BoundaryRequest.CHECKPOINT)
                self._awaiting.append(request)
            elif request.kind is RequestKind.SCALE and request.workers == self.world_size:
                self._size_cap = request.workers
                request.resolve(None)
            else:
                self._begin_planned(request)

    def _begin_planned(self, request: ControlRequest) -> None:
        """A stop or resize: ask for the boundary checkpoint (and a stop) at the agreed step."""
        planned = getattr(self._state, "request", None)  # a stop or resize already being carried out
        if planned is not None:  # a stop overrides a resize in flight; otherwise the first wins
            if request.kind is RequestKind.STOP and planned.kind is RequestKind.SCALE:
                planned.resolve(None)
            else:
                request.resolve(None)
                return
        if request.kind is RequestKind.SCALE and request.reason != "grow":
            self._size_cap = request.workers  # asked for: do not grow back past it
        if not isinstance(self._state, (Running, Resizing)):
            # Nothing runs (scheduling, restarting): a stop ends the run now; a resize waits its turn
            # (the size cap above applies to the next group).
            if request.kind is RequestKind.STOP:
                if self._group is not None:
                    self._group.shutdown()
                self._move(StoppedIdle())
                latest = self.checkpoints.refresh()
                self.goodput.ended(time.time(), latest.step if latest is not None else None, failed=False)
                request.resolve(latest)
            else:
                request.resolve(None)
            return
        assert self._group is not None
        self._group.request_boundary(request.request_id, BoundaryRequest.STOP)
        deadline = self._clock() + self._settings.stop_timeout_s
        self._move(StopPlanned(request, deadline) if request.kind is RequestKind.STOP
                   else ResizePlanned(request, deadline))
        self.goodput.planned(time.time())
        self._event(f"{self.state.value}: checkpoint at the next step boundary every rank reaches"
                    + (f", then regroup with {request.workers} worker(s)" if request.kind is RequestKind.SCALE else ""))

    def _progress_awaiting(self) -> None:
        """Resolve checkpoint requests every rank has carried out (committed before they say so)."""
        live = [self.heartbeats.get(rank) for rank in range(self.world_size)]
        for request in list(self._awaiting):
            handled = [beat.handled for beat in live if beat is not None and beat.handled is not None]
            if len(handled) == len(live) and all(h.request_id >= request.request_id for h in handled):
                self._awaiting.remove(request)
                request.resolve(self.checkpoints.record_of(handled[0].location, handled[0].step))

    def _resolve_awaiting(self, error: BaseException | None) -> None:
        for request in self._awaiting:
            request.reject(error or RayZeroRuntimeError("the run ended before the checkpoint was taken"))
        self._awaiting = []

    def _settle(self, request: ControlRequest) -> None:
        if request.kind is RequestKind.STOP:
            request.resolve(self.checkpoints.refresh())
        elif request.kind is RequestKind.CHECKPOINT:
            request.reject(RayZeroRuntimeError(f"cannot checkpoint: the run already ended ({self.state.value})"))
        else:
            request.resolve(None)

    def _settle_requests(self) -> None:
        self._resolve_awaiting(None)
        with self._lock:
            requests, self._requests = self._requests, []
        for request in requests:
            self._settle(request)
