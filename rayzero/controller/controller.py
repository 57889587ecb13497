"""The controller: an explicit state machine over one worker group per attempt.

`Controller.step()` moves it one transition; `ControllerActor` runs steps in a background thread
inside a Ray actor and lets the driver long-poll the reports and the state. See
[Note: decisions as data] in `state.py` for how failures become actions.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rayzero.controller.control_server import ControlServer
from rayzero.controller.errors import TrainingFailedError
from rayzero.controller.state import Fail, Failure, FailureKind, FailurePolicy, Retry, RunState
from rayzero.controller.worker_group import WorkerGroup, setup_failure
from rayzero.workers.session import Report

# attempt number, resume point -> a fresh (not yet started) worker group
GroupFactory = Callable[[int, str | None], WorkerGroup]


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


class Controller:
    """Drives one run through its states; owns nothing Ray-specific but the group it is given."""

    def __init__(
        self,
        group_factory: GroupFactory,
        train_loop: Callable[..., Any],
        loop_config: dict[str, Any] | None,
        policy: FailurePolicy,
        resume_from: str | None = None,
        checkpoint_dir: str | None = None,
        poll_timeout_s: float = 1.0,
    ) -> None:
        self.state = RunState.INITIALIZING
        self.error: TrainingFailedError | None = None
        self.failures = 0  # failures so far, the policy's budget counter
        self.attempt = 0  # incremented on each restart; passed to the group factory
        self.timings: dict[str, float] = {}
        self.last_checkpoint: str | None = None  # newest checkpoint a loop reported
        self._factory = group_factory
        self._loop = train_loop
        self._loop_config = loop_config
        self._policy = policy
        self._resume_from = resume_from  # what the next attempt resumes from
        self._checkpoint_dir = checkpoint_dir  # where save_checkpoint() commits without a save_dir
        self._poll_timeout_s = poll_timeout_s
        self._group: WorkerGroup | None = None
        self._pending_failure: Failure | None = None
        self._outbox: list[Report] = []  # reports not yet handed to the driver
        self._events: list[str] = []
        self._lock = threading.Lock()  # the actor's poll() reads the outbox from another thread

    def step(self) -> RunState:
        """Make one transition (or, while RUNNING, one poll of the workers)."""
        handler = {
            RunState.INITIALIZING: self._initialize,
            RunState.SCHEDULING: self._schedule,
            RunState.RUNNING: self._run,
            RunState.RESTARTING: self._restart,
        }.get(self.state)
        if handler is not None:
            handler()
        return self.state

    def _initialize(self) -> None:
        self._group = self._factory(self.attempt, self._resume_from)
        self.state = RunState.SCHEDULING

    def _schedule(self) -> None:
        assert self._group is not None
        try:
            timings = self._group.start()
        except Exception as error:  # noqa: BLE001 - every start-up failure goes through the policy
            self._on_failure(setup_failure(error))
            return
        self.timings.update({f"attempt{self.attempt}_{k}" if self.attempt else k: v for k, v in timings.items()})
        self._group.launch(self._loop, self._loop_config)
        self.state = RunState.RUNNING

    def _run(self) -> None:
        assert self._group is not None
        polled = self._group.poll(self._poll_timeout_s)
        with self._lock:
            self._outbox.extend(polled.reports)
        for item in polled.reports:
            if item.checkpoint:
                self.last_checkpoint = item.checkpoint
        if polled.failures:
            self._on_failure(_first_to_blame(polled.failures))
        elif polled.finished:
            self._group.shutdown()
            self.state = RunState.FINISHED

    def _restart(self) -> None:
        assert self._group is not None
        self._group.shutdown()
        self.attempt += 1
        self._resume_from = self._newest_checkpoint() or self._resume_from
        self._group = self._factory(self.attempt, self._resume_from)
        self.state = RunState.SCHEDULING

    def _on_failure(self, failure: Failure) -> None:
        decision = self._policy.decide(failure, self.failures)
        self.failures += 1
        if isinstance(decision, Retry):
            self._event(f"restarting the worker group: {decision.reason}")
            self.state = RunState.RESTARTING
            return
        assert isinstance(decision, Fail)
        if self._group is not None:
            self._group.shutdown()
        self.error = _training_failed(decision.failure)
        self.state = RunState.ERRORED

    def _newest_checkpoint(self) -> str | None:
        if self.last_checkpoint:
            return self.last_checkpoint
        # A loop that saves with engine.save_checkpoint() but never reports it: the checkpoint
        # layer moves `latest` only after a commit, so its presence means there is one to load.
        if self._checkpoint_dir and os.path.exists(os.path.join(self._checkpoint_dir, "latest")):
            return self._checkpoint_dir
        return None

    def _event(self, line: str) -> None:
        with self._lock:
            self._events.append(line)

    def take_update(self) -> ControllerUpdate:
        """Hand the driver everything new since the last call."""
        with self._lock:
            update = ControllerUpdate(self.state, self._outbox, self.error, dict(self.timings), self._events)
            self._outbox, self._events = [], []
        return update


def _first_to_blame(failures: list[Failure]) -> Failure:
    # A loop error names its cause; a rank that died afterwards was usually killed by it.
    order = [FailureKind.LOOP_ERROR, FailureKind.SETUP_ERROR, FailureKind.WORKER_DIED, FailureKind.SCHEDULING]
    return min(failures, key=lambda f: (order.index(f.kind), f.rank if f.rank is not None else 1 << 30))


def _training_failed(failure: Failure) -> TrainingFailedError:
    from rayzero.controller.errors import ResourcesUnavailableError

    if failure.kind is FailureKind.SCHEDULING:
        return ResourcesUnavailableError(failure.message)
    where = f"rank {failure.rank}" if failure.rank is not None else "the worker group"
    message = f"training failed on {where}: {failure.message}"
    if failure.traceback_text:
        message += f"\n\n--- traceback from {where} ---\n{failure.traceback_text.rstrip()}"
    return TrainingFailedError(message, failure.rank, failure.traceback_text)


class ControllerActor:
    """The controller as a Ray actor (threaded): `start()` runs steps in a thread, `poll()` streams."""

    def __init__(self, controller_factory: Callable[[], Controller], run_name: str = "",
                 run_directory: str | None = None) -> None:
        self._controller = controller_factory()
        self._thread: threading.Thread | None = None
        self._changed = threading.Event()  # set after each step, wakes a waiting poll
        self._run_name, self._run_directory = run_name, run_directory  # where control.json goes

    def start(self) -> None:
        import ray

        # The control service (rayzero.v1.Control) serves this actor ([Note: the control seam]).
        self._control = ControlServer(self, self._run_name, self._run_directory,
                                      host=ray.util.get_node_ip_address()).start()
        self._thread = threading.Thread(target=self._loop, name="rayzero-controller", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        controller = self._controller
        while not controller.state.is_terminal:
            try:
                controller.step()
            except Exception as error:  # noqa: BLE001 - a controller bug must still end the run with a reason
                import traceback

                controller.error = TrainingFailedError(
                    f"the rayzero controller failed: {type(error).__name__}: {error}",
                    None,
                    traceback.format_exc(),
                )
                controller.state = RunState.ERRORED
            self._changed.set()
        self._control.close()  # control.json goes first; a Stop waiting for this end still gets its answer

    def poll(self, timeout_s: float) -> ControllerUpdate:
        deadline = time.monotonic() + timeout_s
        while True:
            update = self._controller.take_update()
            if update.state.is_terminal and self._thread is not None:
                self._thread.join(5.0)  # the control service is closed before the driver kills this actor
            if update.reports or update.events or update.state.is_terminal or time.monotonic() >= deadline:
                return update
            self._changed.wait(max(0.0, deadline - time.monotonic()))
            self._changed.clear()
