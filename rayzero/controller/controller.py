"""The controller: an explicit state machine over one worker group per attempt.

`Controller.step()` moves it one transition; `ControllerActor` (actor.py) runs steps in a background
thread inside a Ray actor and lets the driver long-poll the reports and the state. Requests (stop,
resize, checkpoint now) are handled in planned.py, checkpoint discovery in committed_checkpoints.py. See
[Note: decisions as data] in `failures.py` for how failures become actions, [Note: agreed step
boundary] in rayzero/workers/boundary.py for planned stops and resizes, and [Note: the control
seam] in `status.py` for the requests the control plane makes.

    INITIALIZING -> SCHEDULING -> RUNNING -> FINISHED
                         ^           |  \\-> DRAINING (stop: checkpoint, then end) -> FINISHED
                         |           |  \\-> RESIZING (checkpoint, regroup) ---------> SCHEDULING
                         |           \\--> RESTARTING (failure within budget) -------> SCHEDULING
                         \\-- any failure past the budget, or kill ------------------> ERRORED
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rayzero.config.errors import RayZeroRuntimeError
from rayzero.controller import throughput
from rayzero.controller.actor import ControllerActor  # re-exported: fit and the tests import it from here
from rayzero.controller.committed_checkpoints import CheckpointTracker
from rayzero.controller.elastic import BatchPlan
from rayzero.controller.errors import TrainingFailedError, first_to_blame, training_failed
from rayzero.controller.failures import Fail, Failure, FailureKind, FailurePolicy, Retry
from rayzero.controller.goodput import Goodput
from rayzero.controller.health import HangPolicy, Straggler, StragglerPolicy
from rayzero.controller.interval import CheckpointInterval
from rayzero.controller.planned import PlannedStops
from rayzero.controller.requests import ControlRequest, RequestKind
from rayzero.controller.states import (
    ControllerState,
    Draining,
    Ended,
    Errored,
    Event,
    Failed,
    Finished,
    GroupMade,
    Initializing,
    Killed,
    Resizing,
    Restarting,
    Running,
    RunState,
    Scheduling,
    Started,
    describe,
    transition,
)
from rayzero.controller.status import AttemptStart, CheckpointRecord
from rayzero.controller.watch import Watch
from rayzero.controller.worker_group import WorkerGroup, setup_failure
from rayzero.workers.boundary import Heartbeat
from rayzero.workers.session import Report

__all__ = ["Controller", "ControllerActor", "ControllerSettings", "ControllerUpdate"]

logger = logging.getLogger("rayzero.controller")

# what a restart after each kind of failure is called in the run's record (plots, status)
RESTART_CAUSES = {FailureKind.WORKER_DIED: "worker died", FailureKind.HANG: "hang",
                  FailureKind.LOOP_ERROR: "loop error", FailureKind.SETUP_ERROR: "setup error",
                  FailureKind.SCHEDULING: "placement"}

# attempt number, resume point, number of workers -> a fresh (not yet started) worker group
GroupFactory = Callable[[int, str | None, int], WorkerGroup]


@dataclass
class ControllerUpdate:
    """What the driver gets from one poll of the controller."""

    state: RunState
    reports: list[Report] = field(default_factory=list)
    """Reports of every rank since the previous poll, each rank's in order."""
    error: TrainingFailedError | None = None
    """Why the run ended, once it is ERRORED."""
    timings: dict[str, float] = field(default_factory=dict)
    """Start-up phases in seconds (placement group, worker start, process group)."""
    events: list[str] = field(default_factory=list)
    """Lines for the driver's log: restarts and their reasons."""
    stopped: bool = False
    """The run ended through a planned stop (not because every loop finished)."""
    checkpoint: CheckpointRecord | None = None
    """The newest committed checkpoint the controller knows (from the checkpoint layer)."""
    failures: int = 0
    """Restarts charged to the retry budget."""
    world_size: int = 0
    attempt: int = 0
    stragglers: list[Straggler] = field(default_factory=list)
    """Every straggler reported so far in the run ([Note: stragglers] in health.py)."""
    dropped_reports: int = 0
    """Reports dropped so far because the driver did not collect them ([Note: reporting never waits])."""
    attempts: list[AttemptStart] = field(default_factory=list)
    """Attempts begun since the previous poll, with why (the driver records them beside the metrics)."""
    goodput: dict[str, Any] = field(default_factory=dict)
    """The run's goodput and badput by cause so far ([Note: goodput accounting] in goodput.py)."""


@dataclass(frozen=True)
class ControllerSettings:
    """How the controller watches and resizes a run (from FailureConfig and ScalingConfig)."""

    hang: HangPolicy = field(default_factory=HangPolicy)
    stragglers: StragglerPolicy = field(default_factory=StragglerPolicy)
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeat rounds (hang detection and request progress)."""
    grow_interval_s: float = 5.0
    """Seconds between checks for room to grow back towards max_workers."""
    checkpoint_scan_interval_s: float = 30.0
    """Seconds between listings of the checkpoint locations while the group runs, so `status()` sees
    the loop's own saves on storage the heartbeats cannot read (s3://, gs://)."""
    stop_timeout_s: float = 300.0
    """A planned stop or resize waits this long for the boundary checkpoint, then ends the group."""
    checkpoint_locations: tuple[str, ...] = ()
    """Where committed checkpoints are looked for ([Note: checkpoints from the checkpoint layer])."""
    node_local: bool = False
    """Checkpoints live on the workers' disks: learn them from heartbeats ([Note: node-local runs])."""
    goodput_before: dict[str, Any] | None = None
    """What earlier `fit` calls of this run left in `<run>/goodput.json` ([Note: goodput accounting])."""
    started_wall: float | None = None
    """Unix time the `fit` call began: its start-up before the controller existed counts too."""
    checkpoint_interval: str | float | None = None
    """`checkpoint.interval`: "auto", seconds, or None ([Note: a checkpoint interval from the numbers])."""
    failures_per_node_day: float = 419 / (54 * 2048)
    """`checkpoint.failures_per_node_day`: the prior failure rate for "auto"."""


class Controller(PlannedStops, Watch):
    """Drives one run through its states; owns nothing Ray-specific but the group it is given."""

    def __init__(
        self,
        group_factory: GroupFactory,
        train_loop: Callable[..., Any],
        loop_config: dict[str, Any] | None,
        policy: FailurePolicy,
        resume_from: str | None = None,
        poll_timeout_s: float = 1.0,
        plan: BatchPlan | None = None,
        capacity: Callable[[], int | None] = lambda: None,
        draining: Callable[[], set[str]] = set,
        settings: ControllerSettings = ControllerSettings(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._state: ControllerState = Initializing()  # [Note: states that carry their data]
        self.failures = 0  # failures so far, the policy's budget counter
        self._failures_in_a_row = 0  # failures since the newest committed checkpoint changed
        self._checkpoint_at_last_failure: int | None = None  # its step at the previous failure
        self.attempt = 0  # incremented on each restart or resize; passed to the group factory
        self.timings: dict[str, float] = {}
        self.heartbeats: dict[int, Heartbeat | None] = {}  # newest per rank, for status()
        self.message = ""  # the newest event, for status()
        self.last_rank0_report: Report | None = None  # for status(): step, loss, time
        self.first_rank0_report: Report | None = None  # of the current attempt: status()'s rates start here
        self.stragglers: list[Straggler] = []  # reported, in order ([Note: stragglers])
        self._slow_rounds: dict[int, int] = {}  # rank -> consecutive heartbeat rounds it was slow
        self._factory = group_factory
        self._loop = train_loop
        self._loop_config = loop_config
        self._policy = policy
        self._plan = plan or BatchPlan(1, 1, None)
        self._capacity = capacity  # how many worker bundles fit in the cluster now (None: unknown)
        self._draining = draining  # ids of nodes Ray is draining (preemption notices)
        self._settings = settings
        self._clock = clock
        self._resume_from = resume_from  # what the next attempt resumes from
        self._poll_timeout_s = poll_timeout_s
        self._outbox: list[Report] = []  # reports not yet handed to the driver
        self._attempts: list[AttemptStart] = []  # attempts begun, not yet handed to the driver
        self.max_outbox = 100_000  # the bound on that while the driver does not poll (it drops the rest)
        self.dropped_reports = 0
        self._events: list[str] = []
        self._lock = threading.Lock()  # requests and take_update come from other threads
        self._requests: list[ControlRequest] = []  # recorded, not yet taken by step()
        self._awaiting: list[ControlRequest] = []  # sent to the workers, waiting for the boundary
        self._next_heartbeat = 0.0
        self._next_grow_check = 0.0
        self._next_checkpoint_scan = 0.0
        self.heard_at: dict[int, float] = {}  # rank -> clock of its last heartbeat answer (status, hangs)
        self.heartbeat_rounds = 0  # rounds taken so far: status() rebuilds its rank table once per round
        self.checkpoints = CheckpointTracker(settings.checkpoint_locations, settings.node_local)
        # [Note: goodput accounting]: wall-clock times, as the workers stamp their reports
        self.goodput = Goodput(settings.started_wall or time.time(), settings.goodput_before)
        self._goodput_checkpoint: int | None = None  # the newest checkpoint step goodput was told of
        # [Note: a checkpoint interval from the numbers]
        self.interval = CheckpointInterval(settings.checkpoint_interval, settings.failures_per_node_day,
                                           settings.goodput_before)  # the run's earlier failures count too
        self._interval_request: ControlRequest | None = None  # the checkpoint it asked for, until done
        self._attempt_started_at = time.time()  # for the interval before the attempt's first checkpoint
        self._size_cap: int | None = None  # an explicit scale(n) caps growing back at n

    # ---- views of the state ([Note: states that carry their data]) --------------------------
    @property
    def state(self) -> RunState:
        return self._state.kind

    @property
    def current(self) -> ControllerState:
        """The state with its data."""
        return self._state

    @property
    def error(self) -> TrainingFailedError | None:
        return self._state.error if isinstance(self._state, Errored) else None

    @property
    def stopped(self) -> bool:
        """The run ended through a planned stop (not because every loop finished)."""
        return isinstance(self._state, Finished) and self._state.stopped

    @property
    def world_size(self) -> int:
        """Workers in the running group (0 while none runs)."""
        return getattr(self._state, "world_size", 0)

    @property
    def _group(self) -> WorkerGroup | None:
        return getattr(self._state, "group", None)

    def _move(self, event: Event) -> None:
        """Every transition goes through here, and is logged."""
        before = self._state
        self._state = transition(before, event)
        logger.info("state %s -> %s on %s", describe(before), describe(self._state), type(event).__name__)

    def fail_with(self, error: TrainingFailedError) -> None:
        """End the run with `error` whatever the state (the actor's last resort on a controller bug)."""
        if not self.state.is_terminal:
            request = getattr(self._state, "request", None)
            self._state = Errored(error)
            logger.info("state -> errored on a controller failure")
            latest = self.checkpoints.latest
            self.goodput.ended(time.time(), latest.step if latest is not None else None, failed=True)
            if request is not None:
                self._settle(request)

    # ---- the state machine -----------------------------------------------------------------
    def step(self) -> RunState:
        """Make one transition (or, while the group runs, one poll of the workers)."""
        self._take_requests()
        handler = {
            Initializing: self._initialize,
            Scheduling: self._schedule,
            Running: self._run,
            Draining: self._run,
            Resizing: self._run,
            Restarting: self._restart,
        }.get(type(self._state))
        if handler is not None:
            handler()
        if self.state.is_terminal:
            self._settle_requests()
        return self.state

    def _initialize(self) -> None:
        workers = self._plan.choose(self._capacity())
        if workers is None:
            workers = self._smallest()
            self._event(f"fewer than {workers} worker(s) fit now; waiting for room (placement_timeout_s)")
        self._new_group(workers, "rerun" if self._resume_from else "start")

    def _smallest(self) -> int:
        return min(self._plan.valid_sizes() or [self._plan.min_workers])

    def _new_group(self, workers: int, cause: str, new_attempt: bool = True) -> None:
        """Make the group for an attempt (`new_attempt` False: a smaller try of the same one)."""
        if new_attempt:
            latest = self.checkpoints.latest
            resumed = latest.step if latest is not None and self._resume_from else None
            with self._lock:
                self._attempts.append(AttemptStart(self.attempt, cause, time.time(), resumed, workers, self.failures))
            self.goodput.attempt_began(self.attempt, cause, time.time(), resumed)
            self._attempt_started_at = time.time()
        group = self._factory(self.attempt, self._resume_from, workers)
        self._move(GroupMade(group, self.attempt, workers, cause))

    def _schedule(self) -> None:
        state = self._state
        assert isinstance(state, Scheduling)
        self._event(f"attempt {self.attempt}: placing {state.workers} worker(s), then forming their process group")
        try:
            timings = state.group.start()
        except Exception as error:  # noqa: BLE001 - every start-up failure goes through the policy
            failure = setup_failure(error)
            smaller = self._plan.choose(state.workers - 1) if failure.kind is FailureKind.SCHEDULING else None
            if smaller is not None and smaller >= self._plan.min_workers:
                # Elastic: fewer workers fit than planned (a node went away meanwhile); not a failure.
                self._event(f"{state.workers} worker(s) did not fit; trying {smaller}")
                state.group.shutdown()
                self._new_group(smaller, state.cause, new_attempt=False)
                return
            self._on_failure(failure)
            return
        self.timings.update({f"attempt{self.attempt}_{k}" if self.attempt else k: v for k, v in timings.items()})
        self.heard_at = {rank: self._clock() for rank in range(state.workers)}
        self.heartbeats, self._slow_rounds = {}, {}
        state.group.launch(self._loop, self._loop_config)
        self._move(Started(state.workers))
        self.goodput.placement_waited(timings.get("placement_group_s", 0.0), time.time())
        self._next_grow_check = self._clock() + self._settings.grow_interval_s
        self._event(f"attempt {self.attempt}: {self.world_size} worker(s) running"
                    + (f", resuming from {self._resume_from}" if self._resume_from else ""))

    def _run(self) -> None:
        state = self._state
        assert isinstance(state, (Running, Draining, Resizing))
        # a poll waits no longer than the next heartbeat round is due: rounds keep their interval, so
        # a hang is seen within one interval of its limit ([Note: hang detection] in health.py)
        polled = state.group.poll(min(self._poll_timeout_s, max(0.0, self._next_heartbeat - self._clock())))
        with self._lock:
            room = max(0, self.max_outbox - len(self._outbox))
            self._outbox.extend(polled.reports[:room])
            self.dropped_reports += max(0, len(polled.reports) - room)
        for item in polled.reports:
            if item.rank == 0:
                self.goodput.reported(item.metrics.get("step"), item.time)
                if self.first_rank0_report is None or throughput.went_back(item, self.last_rank0_report):
                    self.first_rank0_report = item
                self.last_rank0_report = item
            if item.checkpoint:
                self.checkpoints.note_reported(item.checkpoint)
        if polled.failures:
            self._on_failure(first_to_blame(polled.failures))
            return
        if polled.finished:
            self.goodput.save_stalled(polled.save_stall_s, time.time())  # saves after the last heartbeat
            self.checkpoints.note_heartbeat(polled.committed)  # a node-local boundary save no heartbeat saw
            if polled.stopped and isinstance(state, Running):  # nobody asked: a worker was preempted
                return self._regroup_after_preemption(polled.preempted)
            self._group_ended(stopped=polled.stopped)
            return
        now = self._clock()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self._settings.heartbeat_interval_s
            if not self._check_heartbeats(now):
                return
        if isinstance(self._state, Running):
            self._maybe_grow(now)
        elif isinstance(self._state, (Draining, Resizing)) and now >= self._state.deadline:
            self._event(f"the boundary checkpoint did not come within {self._settings.stop_timeout_s:g}s "
                        "(does the loop step a rayzero engine?); ending the group without it")
            self._group_ended(stopped=True)

    def _group_ended(self, stopped: bool) -> None:
        """Every rank's loop returned: the run finished, or a planned stop/resize reached its end."""
        state = self._state
        assert isinstance(state, (Running, Draining, Resizing))
        state.group.shutdown(until_free=True)  # what comes next sizes itself to the free slots
        self._resolve_awaiting(error=None)
        if isinstance(state, Resizing) and stopped:
            self.attempt += 1
            self._resume_from = self.checkpoints.resume_location() or self._resume_from
            state.request.resolve(None)
            self._new_group(state.request.workers, f"resize {state.request.reason}".strip())
            return
        latest = self.checkpoints.refresh()  # what the run leaves behind, for Result and status()
        self._move(Ended(stopped))
        self.goodput.ended(time.time(), latest.step if latest is not None else None, failed=False)
        if isinstance(state, (Draining, Resizing)):
            state.request.resolve(latest)

    def _regroup_after_preemption(self, ranks: list[int]) -> None:
        """A worker got SIGTERM ([Note: preemption] in rayzero/workers/actor.py): the group saved at
        the agreed boundary and stopped; go on with as many workers as now fit. Not a failure."""
        assert self._group is not None
        self._group.shutdown(until_free=True)
        self._resolve_awaiting(None)
        self.attempt += 1
        self._resume_from = self.checkpoints.resume_location() or self._resume_from
        step = self.checkpoints.latest.step if self.checkpoints.latest is not None else None
        self._event(f"rank(s) {ranks or '?'} preempted (SIGTERM): checkpoint committed at step {step}; regrouping")
        workers = self._plan.choose(self._capacity())
        self._new_group(workers if workers is not None else self._smallest(), "preemption")

    def _restart(self) -> None:
        state = self._state
        assert isinstance(state, Restarting)
        if self._clock() < state.not_before:
            time.sleep(min(0.2, state.not_before - self._clock()))
            return
        self.attempt += 1
        self._resume_from = self.checkpoints.resume_location() or self._resume_from
        workers = self._plan.choose(self._capacity())  # as many as fit now, not the old count
        self._new_group(workers if workers is not None else self._smallest(), state.cause)

    def _on_failure(self, failure: Failure) -> None:
        newest = self.checkpoints.refresh()
        newest_step = newest.step if newest is not None else None
        if newest_step != self._checkpoint_at_last_failure:  # progress since the previous failure
            self._failures_in_a_row = 0
        self._checkpoint_at_last_failure = newest_step
        decision = self._policy.decide(failure, self.failures, self._failures_in_a_row)
        self.goodput.failed(time.time())
        self.failures += 1
        self._failures_in_a_row += 1
        self._resolve_awaiting(RayZeroRuntimeError(f"the worker group failed first: {failure.message.splitlines()[0]}"))
        if isinstance(decision, Fail):
            self._end_errored(decision.failure, self._policy.ending(self.failures, self._failures_in_a_row - 1))
            return
        assert isinstance(decision, Retry)
        planned = getattr(self._state, "request", None)
        if planned is not None:  # a stop still ends the run; a resize regroups anyway
            if planned.kind is RequestKind.STOP:
                return self._end_errored(failure)
            planned.resolve(None)
        if self._group is not None:
            self._group.shutdown()  # now, not after the backoff: its resources are free meanwhile
        self._event(f"restarting the worker group: {decision.reason}")
        self._move(Failed(RESTART_CAUSES.get(failure.kind, failure.kind.value), decision.reason,
                          not_before=self._clock() + self._policy.backoff(self._failures_in_a_row)))

    def _end_errored(self, failure: Failure, why: str = "", killed: bool = False) -> None:
        if self._group is not None:
            self._group.shutdown()
        latest = self.checkpoints.latest
        resume = (f"the checkpoint of step {latest.step} ({latest.location})" if latest is not None
                  else "the start (no checkpoint was committed)")
        error = training_failed(failure, (f"{why}. " if why else "")
                                + f"Run it again with the same name and storage to resume from {resume}.")
        request = getattr(self._state, "request", None)  # a planned stop or resize being carried out
        self._move(Killed(error) if killed else Failed(failure.kind.value, failure.message, error=error))
        self.goodput.ended(time.time(), latest.step if latest is not None else None, failed=True)
        if request is not None:
            self._settle(request)

    @property
    def latest_checkpoint(self) -> CheckpointRecord | None:
        return self.checkpoints.latest

    def clock(self) -> float:
        """The controller's clock (what `heard_at` is measured on)."""
        return self._clock()

    @property
    def plan(self) -> BatchPlan:
        return self._plan

    @property
    def policy_budget(self) -> int:
        return self._policy.max_failures

    def _event(self, line: str) -> None:
        logger.info("%s", line)
        with self._lock:
            self._events.append(line)
            self.message = line

    def take_update(self) -> ControllerUpdate:
        """Hand the driver everything new since the last call."""
        with self._lock:
            update = ControllerUpdate(self.state, self._outbox, self.error, dict(self.timings), self._events,
                                      self.stopped, self.checkpoints.latest, self.failures, self.world_size,
                                      self.attempt, list(self.stragglers), self.dropped_reports, self._attempts,
                                      {**self.goodput.snapshot(time.time()),  # and the interval's record for a rerun
                                       **self.interval.record(self.failures, self.state.is_terminal)})
            self._outbox, self._events, self._attempts = [], [], []
        return update
