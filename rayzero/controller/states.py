"""The controller's states, each holding the data it needs, and the one function that moves between them.

[Note: states that carry their data]
Following Ray Train v2's controller, a state is a small frozen value: `Scheduling(group, attempt,
workers, cause)`, `Running(group, attempt, world_size)`, `Draining(..., request, deadline)`,
`Resizing(..., request, deadline)`, `Restarting(cause, reason, not_before)`, `Finished(stopped)`,
`Errored(error)`. What a state needs travels with it, so no attribute of the controller is
meaningful in one state and stale in the others (the group, a planned stop's deadline, a retry's
backoff). `transition(state, event)` is the one place the run moves: it checks the event is one the
state can take and returns the next state; the controller logs every transition
(`Controller._move`) and performs the side effects around it (making a group, shutting one down).
Decisions of the failure policy (`Retry`, `Fail` in failures.py) arrive as the `Failed` event.

    Initializing --GroupMade--> Scheduling --Started--> Running --Ended--> Finished
         Scheduling --GroupMade (smaller)--> Scheduling
         Running/Resizing --StopPlanned--> Draining --Ended--> Finished
         Running --ResizePlanned--> Resizing --GroupMade--> Scheduling
         Running/Draining/Resizing/Scheduling --Failed(Retry)--> Restarting --GroupMade--> Scheduling
         Running --GroupMade (preempted)--> Scheduling
         any --Failed(Fail) or Killed--> Errored;  not running --StoppedIdle--> Finished
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar, Union


class RunState(enum.Enum):
    """Where the run is. Terminal states: FINISHED, ERRORED."""

    INITIALIZING = "initializing"  # nothing started yet
    SCHEDULING = "scheduling"  # waiting for the placement group, starting workers, forming the group
    RUNNING = "running"  # the loops run; reports stream
    RESTARTING = "restarting"  # a failure is being handled by tearing the group down to reschedule
    RESIZING = "resizing"  # planned: checkpoint at the agreed boundary, then regroup at a new size
    DRAINING = "draining"  # planned stop: checkpoint at the agreed boundary, then end the run
    FINISHED = "finished"  # every rank's loop returned
    ERRORED = "errored"  # the policy gave up; `Controller.error` says why

    @property
    def is_terminal(self) -> bool:
        return self in (RunState.FINISHED, RunState.ERRORED)


@dataclass(frozen=True)
class Initializing:
    kind: ClassVar[RunState] = RunState.INITIALIZING


@dataclass(frozen=True)
class Scheduling:
    """A worker group is being placed, started and joined into a process group."""

    kind: ClassVar[RunState] = RunState.SCHEDULING
    group: Any
    attempt: int
    workers: int
    """The size being tried (elastic runs may try smaller ones in turn)."""
    cause: str
    """Why this attempt began: start, rerun, worker died, hang, preemption, resize, ..."""


@dataclass(frozen=True)
class _GroupUp:
    """The fields of every state whose group has started: Running, Draining, Resizing."""

    group: Any
    attempt: int
    world_size: int


@dataclass(frozen=True)
class Running(_GroupUp):
    """The loops run; reports stream."""

    kind: ClassVar[RunState] = RunState.RUNNING


@dataclass(frozen=True)
class _Planned(_GroupUp):
    """A planned stop or resize: the ranks checkpoint at the agreed boundary (Draining, Resizing)."""

    request: Any
    deadline: float
    """Clock time after which the group ends without the boundary checkpoint."""


@dataclass(frozen=True)
class Draining(_Planned):
    """A planned stop: the ranks checkpoint at the agreed boundary, then the run ends."""

    kind: ClassVar[RunState] = RunState.DRAINING


@dataclass(frozen=True)
class Resizing(_Planned):
    """A planned resize: checkpoint at the agreed boundary, then regroup at `request.workers`."""

    kind: ClassVar[RunState] = RunState.RESIZING


@dataclass(frozen=True)
class Restarting:
    """A failure within the budget: the group is down; a new one is made after the backoff."""

    kind: ClassVar[RunState] = RunState.RESTARTING
    cause: str
    reason: str
    not_before: float


@dataclass(frozen=True)
class Finished:
    kind: ClassVar[RunState] = RunState.FINISHED
    stopped: bool
    """Ended through a planned stop (its checkpoint committed), not because every loop returned."""


@dataclass(frozen=True)
class Errored:
    kind: ClassVar[RunState] = RunState.ERRORED
    error: Any
    """The TrainingFailedError the run ends with."""


ControllerState = Union[Initializing, Scheduling, Running, Draining, Resizing, Restarting, Finished, Errored]
WITH_GROUP = (Scheduling, Running, Draining, Resizing)


# ---- events ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GroupMade:
    """A fresh (not yet started) group exists: the first, a retry, a smaller try, a regroup."""

    group: Any
    attempt: int
    workers: int
    cause: str


@dataclass(frozen=True)
class Started:
    world_size: int


@dataclass(frozen=True)
class Ended:
    """Every rank's loop returned (or a planned stop gave up waiting for the boundary)."""

    stopped: bool


@dataclass(frozen=True)
class StopPlanned:
    request: Any
    deadline: float


@dataclass(frozen=True)
class ResizePlanned:
    request: Any
    deadline: float


@dataclass(frozen=True)
class Failed:
    """The failure policy's decision: retry after `not_before` (`error` None), or end with `error`."""

    cause: str
    reason: str
    not_before: float = 0.0
    error: Any = None


@dataclass(frozen=True)
class Killed:
    error: Any


@dataclass(frozen=True)
class StoppedIdle:
    """A stop while no group runs (scheduling, restarting): the run ends at once."""


Event = Union[GroupMade, Started, Ended, StopPlanned, ResizePlanned, Failed, Killed, StoppedIdle]


class InvalidTransition(AssertionError):
    """A state was given an event it cannot take: a controller bug, never a user's mistake."""


def transition(state: ControllerState, event: Event) -> ControllerState:
    """The next state ([Note: states that carry their data]). Pure: no side effects."""
    if isinstance(state, (Finished, Errored)):
        raise InvalidTransition(f"{type(state).__name__} is final; got {type(event).__name__}")
    if isinstance(event, Killed):
        return Errored(event.error)
    if isinstance(event, Failed):
        if event.error is not None:
            return Errored(event.error)
        if isinstance(state, (Scheduling, Running, Draining, Resizing)):
            return Restarting(event.cause, event.reason, event.not_before)
    elif isinstance(event, GroupMade):
        if isinstance(state, (Initializing, Scheduling, Restarting, Running, Resizing)):
            return Scheduling(event.group, event.attempt, event.workers, event.cause)
    elif isinstance(event, Started):
        if isinstance(state, Scheduling):
            return Running(state.group, state.attempt, event.world_size)
    elif isinstance(event, Ended):
        if isinstance(state, (Running, Draining, Resizing)):
            return Finished(event.stopped)
    elif isinstance(event, StopPlanned):  # a stop also overrides a resize in flight
        if isinstance(state, (Running, Resizing)):
            return Draining(state.group, state.attempt, state.world_size, event.request, event.deadline)
    elif isinstance(event, ResizePlanned):
        if isinstance(state, Running):
            return Resizing(state.group, state.attempt, state.world_size, event.request, event.deadline)
    elif isinstance(event, StoppedIdle):
        if not isinstance(state, (Running, Draining, Resizing)):
            return Finished(stopped=True)
    raise InvalidTransition(f"{type(state).__name__} cannot take {type(event).__name__}")


def describe(state: ControllerState) -> str:
    """One line for the log: the state and its data (no group objects)."""
    fields = {key: value for key, value in vars(state).items() if key not in ("group", "request", "error")}
    if getattr(state, "request", None) is not None:
        fields["request"] = state.request.kind.value
    return f"{state.kind.value}" + (f" {fields}" if fields else "")
