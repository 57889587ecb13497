"""The controller's states and the one function that moves between them (issue 23 item 2):
every transition the controller makes, its data carried along, and the events a state refuses."""
from __future__ import annotations

import pytest

from rayzero.controller.requests import ControlRequest, RequestKind
from rayzero.controller.states import (
    Draining,
    Ended,
    Errored,
    Failed,
    Finished,
    GroupMade,
    Initializing,
    InvalidTransition,
    Killed,
    ResizePlanned,
    Resizing,
    Restarting,
    Running,
    RunState,
    Scheduling,
    Started,
    StoppedIdle,
    StopPlanned,
    describe,
    transition,
)

pytestmark = pytest.mark.unit

GROUP, OTHER = object(), object()
STOP, SCALE = ControlRequest(RequestKind.STOP), ControlRequest(RequestKind.SCALE, workers=1, reason="scale")


def test_a_run_from_start_to_finish_carries_its_data():
    state = transition(Initializing(), GroupMade(GROUP, 0, 2, "start"))
    assert state == Scheduling(GROUP, 0, 2, "start") and state.kind is RunState.SCHEDULING
    state = transition(state, GroupMade(OTHER, 0, 1, "start"))  # elastic: a smaller try of the same attempt
    assert state == Scheduling(OTHER, 0, 1, "start")
    state = transition(state, Started(1))
    assert state == Running(OTHER, 0, 1)
    assert transition(state, Ended(stopped=False)) == Finished(stopped=False)


def test_planned_stops_and_resizes_hold_their_request_and_deadline():
    running = Running(GROUP, 3, 2)
    draining = transition(running, StopPlanned(STOP, 42.0))
    assert draining == Draining(GROUP, 3, 2, STOP, 42.0) and draining.kind is RunState.DRAINING
    assert transition(draining, Ended(stopped=True)) == Finished(stopped=True)
    resizing = transition(running, ResizePlanned(SCALE, 43.0))
    assert resizing == Resizing(GROUP, 3, 2, SCALE, 43.0)
    assert transition(resizing, GroupMade(OTHER, 4, 1, "resize scale")) == Scheduling(OTHER, 4, 1, "resize scale")
    assert transition(resizing, StopPlanned(STOP, 50.0)) == Draining(GROUP, 3, 2, STOP, 50.0)  # a stop wins


def test_failures_restart_or_end_and_a_kill_ends_anything_but_the_end():
    for state in (Scheduling(GROUP, 0, 2, "start"), Running(GROUP, 0, 2), Draining(GROUP, 0, 2, STOP, 1.0),
                  Resizing(GROUP, 0, 2, SCALE, 1.0)):
        assert transition(state, Failed("hang", "rank 1 hung", not_before=7.0)) == Restarting("hang", "rank 1 hung", 7.0)
        assert transition(state, Failed("hang", "rank 1 hung", error="fatal")) == Errored("fatal")
        assert transition(state, Killed("killed")) == Errored("killed")
    restarting = Restarting("worker died", "rank 0 died", 5.0)
    assert transition(restarting, GroupMade(GROUP, 1, 2, "worker died")) == Scheduling(GROUP, 1, 2, "worker died")
    assert transition(restarting, StoppedIdle()) == Finished(stopped=True)
    assert transition(Running(GROUP, 0, 2), GroupMade(OTHER, 1, 2, "preemption")).cause == "preemption"


@pytest.mark.parametrize(("state", "event"), [
    (Initializing(), Started(2)),
    (Restarting("hang", "", 0.0), Ended(True)),
    (Scheduling(GROUP, 0, 2, "start"), StopPlanned(STOP, 1.0)),  # nothing runs: the controller ends it idle
    (Draining(GROUP, 0, 2, STOP, 1.0), ResizePlanned(SCALE, 1.0)),
    (Running(GROUP, 0, 2), StoppedIdle()),
    (Finished(False), Killed("late")),
    (Errored("x"), GroupMade(GROUP, 1, 2, "start")),
])
def test_an_event_a_state_cannot_take_is_a_controller_bug(state, event):
    with pytest.raises(InvalidTransition):
        transition(state, event)


def test_the_log_line_names_the_state_and_its_data_not_the_group():
    line = describe(Draining(GROUP, 3, 2, STOP, 42.0))
    assert line.startswith("draining") and "'deadline': 42.0" in line and "'request': 'stop'" in line
    assert "object at" not in line
