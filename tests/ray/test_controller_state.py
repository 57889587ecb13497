"""The controller's state machine, driven one step() at a time with a fake worker group (no Ray)."""
from __future__ import annotations

import pickle

import pytest

from rayzero.controller.controller import Controller
from rayzero.controller.errors import ResourcesUnavailableError, TrainingFailedError
from rayzero.controller.state import Failure, FailureKind, FailurePolicy, RunState
from rayzero.controller.worker_group import GroupPoll, assign_ranks
from rayzero.workers.actor import NodeInfo
from rayzero.workers.session import Report


class FakeGroup:
    """Plays back queued poll results; records what the controller asked of it."""

    def __init__(self, polls: list[GroupPoll], start_error: Exception | None = None) -> None:
        self.polls = list(polls)
        self.start_error = start_error
        self.calls: list[str] = []

    def start(self) -> dict[str, float]:
        self.calls.append("start")
        if self.start_error is not None:
            raise self.start_error
        return {"placement_group_s": 0.1}

    def launch(self, train_loop, loop_config) -> None:
        self.calls.append("launch")

    def poll(self, timeout_s: float) -> GroupPoll:
        self.calls.append("poll")
        return self.polls.pop(0)

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def _report(rank: int, seq: int, checkpoint: str | None = None) -> Report:
    return Report(rank, seq, 0.0, {"step": seq}, checkpoint)


def _controller(groups: list[FakeGroup], max_failures: int = 0) -> tuple[Controller, list[tuple]]:
    made: list[tuple] = []

    def factory(attempt: int, resume_from: str | None) -> FakeGroup:
        made.append((attempt, resume_from))
        return groups[len(made) - 1]

    return Controller(factory, lambda: None, None, FailurePolicy(max_failures)), made


def test_happy_path_moves_through_every_state_in_order():
    group = FakeGroup([GroupPoll(reports=[_report(0, 0)]), GroupPoll(reports=[_report(0, 1)], finished=True)])
    controller, _ = _controller([group])
    states = [controller.step() for _ in range(4)]
    assert states == [RunState.SCHEDULING, RunState.RUNNING, RunState.RUNNING, RunState.FINISHED]
    assert group.calls == ["start", "launch", "poll", "poll", "shutdown"]
    update = controller.take_update()
    assert [r.seq for r in update.reports] == [0, 1] and update.state is RunState.FINISHED
    assert controller.take_update().reports == []  # handed over once


def test_loop_error_without_budget_errors_with_rank_and_traceback():
    failure = Failure(FailureKind.LOOP_ERROR, "rank 1 raised ValueError: boom", 1, "Traceback ...\nValueError: boom")
    group = FakeGroup([GroupPoll(failures=[failure])])
    controller, _ = _controller([group])
    while not controller.step().is_terminal:
        pass
    assert controller.state is RunState.ERRORED
    assert controller.error.rank == 1
    assert "rank 1" in str(controller.error) and "ValueError: boom" in controller.error.traceback_text
    assert group.calls[-1] == "shutdown"


def test_retry_restarts_from_the_newest_reported_checkpoint_then_finishes():
    failing = FakeGroup([
        GroupPoll(reports=[_report(0, 0, checkpoint="file:///ckpt/step1")]),
        GroupPoll(failures=[Failure(FailureKind.WORKER_DIED, "rank 0's worker died", 0)]),
    ])
    healthy = FakeGroup([GroupPoll(finished=True)])
    controller, made = _controller([failing, healthy], max_failures=1)
    seen = []
    while not controller.state.is_terminal:
        seen.append(controller.step())
    assert RunState.RESTARTING in seen and controller.state is RunState.FINISHED
    assert made == [(0, None), (1, "file:///ckpt/step1")]
    assert "shutdown" in failing.calls
    assert any("restarting" in line for line in controller.take_update().events)


def test_budget_is_shared_across_attempts():
    died = GroupPoll(failures=[Failure(FailureKind.WORKER_DIED, "died", 0)])
    controller, made = _controller([FakeGroup([died]), FakeGroup([died])], max_failures=1)
    while not controller.step().is_terminal:
        pass
    assert controller.state is RunState.ERRORED and len(made) == 2


def test_unschedulable_group_is_not_retried():
    group = FakeGroup([], start_error=ResourcesUnavailableError("could not place 2 worker(s)"))
    controller, made = _controller([group], max_failures=5)
    while not controller.step().is_terminal:
        pass
    assert isinstance(controller.error, ResourcesUnavailableError) and len(made) == 1


def test_a_loop_error_is_blamed_before_ranks_that_died_after_it():
    group = FakeGroup([GroupPoll(failures=[
        Failure(FailureKind.WORKER_DIED, "rank 0 died", 0),
        Failure(FailureKind.LOOP_ERROR, "rank 1 raised KeyError", 1, "tb"),
    ])])
    controller, _ = _controller([group])
    while not controller.step().is_terminal:
        pass
    assert controller.error.rank == 1


@pytest.mark.parametrize(
    "error",
    [TrainingFailedError("training failed on rank 3", 3, "Traceback..."), ResourcesUnavailableError("no room")],
)
def test_errors_survive_pickling_with_their_fields(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert copy.rank == error.rank and copy.traceback_text == error.traceback_text


def test_ranks_are_contiguous_per_node_and_ordered_by_gpu():
    infos = [
        NodeInfo("nodeB", "10.0.0.2", ("1",), 1),
        NodeInfo("nodeA", "10.0.0.1", ("0",), 2),
        NodeInfo("nodeB", "10.0.0.2", ("0",), 3),
        NodeInfo("nodeA", "10.0.0.1", ("1",), 4),
    ]
    ranks = assign_ranks(infos)
    # nodeB appears first: its workers get ranks 0-1, GPU 0 before GPU 1.
    assert ranks == [(1, 1, 2), (2, 0, 2), (0, 0, 2), (3, 1, 2)]
