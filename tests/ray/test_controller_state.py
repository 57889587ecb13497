"""The controller's state machine, driven one step() at a time with a fake worker group (no Ray)."""
from __future__ import annotations

import pickle

import pytest

from rayzero.checkpoint.manifest import Manifest, commit
from rayzero.controller.controller import Controller, ControllerSettings
from rayzero.controller.errors import ResourcesUnavailableError, TrainingFailedError
from rayzero.controller.state import Failure, FailureKind, FailurePolicy, RunState
from rayzero.controller.worker_group import GroupPoll, assign_ranks
from rayzero.workers.actor import NodeInfo
from rayzero.workers.session import Report


class FakeGroup:
    """Plays back queued poll results and heartbeats; records what the controller asked of it."""

    def __init__(self, polls: list[GroupPoll], start_error: Exception | None = None,
                 beats: list[dict] | None = None) -> None:
        self.polls = list(polls)
        self.start_error = start_error
        self.beats = list(beats or [])
        self.calls: list[str] = []
        self.requests: list[tuple[int, int]] = []

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

    def heartbeats(self, timeout_s: float):
        self.calls.append("heartbeats")
        return (self.beats.pop(0) if self.beats else {}), []

    def request_boundary(self, request_id: int, kind: int) -> None:
        self.calls.append("request_boundary")
        self.requests.append((request_id, int(kind)))

    def stacks(self, timeout_s: float) -> dict[int, str]:
        return {0: "File loop.py, in step\n  dist.all_reduce", 1: "File loop.py, in load\n  time.sleep(3600)"}

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def _report(rank: int, seq: int, checkpoint: str | None = None) -> Report:
    return Report(rank, seq, 0.0, {"step": seq}, checkpoint)


def _controller(groups: list[FakeGroup], max_failures: int = 0, **options) -> tuple[Controller, list[tuple]]:
    made: list[tuple] = []

    def factory(attempt: int, resume_from: str | None, workers: int) -> FakeGroup:
        made.append((attempt, resume_from))
        groups[len(made) - 1].workers = workers
        return groups[len(made) - 1]

    return Controller(factory, lambda: None, None, FailurePolicy(max_failures), **options), made


def test_happy_path_moves_through_every_state_in_order():
    group = FakeGroup([GroupPoll(reports=[_report(0, 0)]), GroupPoll(reports=[_report(0, 1)], finished=True)])
    controller, _ = _controller([group])
    states = [controller.step() for _ in range(4)]
    assert states == [RunState.SCHEDULING, RunState.RUNNING, RunState.RUNNING, RunState.FINISHED]
    assert group.calls == ["start", "launch", "poll", "heartbeats", "poll", "shutdown"]
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


def _commit(root, step: int) -> str:
    """A committed checkpoint as the checkpoint layer writes it (a manifest is the commit)."""
    tag_dir = root / f"global_step{step}"
    tag_dir.mkdir(parents=True)
    commit(str(tag_dir), Manifest(f"global_step{step}", step, 2, 1, "", {}, {}, []))
    return str(tag_dir)


def test_retry_resumes_from_the_newest_committed_checkpoint_not_from_what_was_reported(tmp_path):
    reported = tmp_path / "reported"
    committed = _commit(reported, 3)
    (reported / "global_step9").mkdir()  # reported but never committed (no manifest): not a checkpoint
    failing = FakeGroup([
        GroupPoll(reports=[_report(0, 0, checkpoint=committed), _report(0, 1, checkpoint=str(reported / "global_step9"))]),
        GroupPoll(failures=[Failure(FailureKind.WORKER_DIED, "rank 0's worker died", 0)]),
    ])
    healthy = FakeGroup([GroupPoll(finished=True)])
    controller, made = _controller([failing, healthy], max_failures=1)
    seen = []
    while not controller.state.is_terminal:
        seen.append(controller.step())
    assert RunState.RESTARTING in seen and controller.state is RunState.FINISHED
    assert made == [(0, None), (1, str(reported))]
    assert controller.latest_checkpoint.step == 3
    assert "shutdown" in failing.calls
    assert any("restarting" in line for line in controller.take_update().events)


def test_restart_prefers_the_run_directory_when_it_holds_a_newer_checkpoint(tmp_path):
    run_dir = tmp_path / "run" / "checkpoints"
    _commit(run_dir, 7)
    old = _commit(tmp_path / "elsewhere", 5)
    groups = [FakeGroup([GroupPoll(reports=[_report(0, 0, checkpoint=old)]),
                         GroupPoll(failures=[Failure(FailureKind.LOOP_ERROR, "boom", 1)])]),
              FakeGroup([GroupPoll(finished=True)])]
    controller, made = _controller(groups, max_failures=1,
                                   settings=ControllerSettings(checkpoint_locations=(str(run_dir),)))
    while not controller.step().is_terminal:
        pass
    assert made[1] == (1, str(run_dir)) and controller.latest_checkpoint.step == 7


def test_budget_is_shared_across_attempts():
    died = GroupPoll(failures=[Failure(FailureKind.WORKER_DIED, "died", 0)])
    controller, made = _controller([FakeGroup([died]), FakeGroup([died])], max_failures=1)
    while not controller.step().is_terminal:
        pass
    assert controller.state is RunState.ERRORED and len(made) == 2


def test_unschedulable_group_fails_at_once_without_budget_and_retries_within_it():
    group = FakeGroup([], start_error=ResourcesUnavailableError("could not place 2 worker(s)"))
    controller, made = _controller([group])
    while not controller.step().is_terminal:
        pass
    assert isinstance(controller.error, ResourcesUnavailableError) and len(made) == 1
    # with a budget the placement is tried again (after the backoff) instead of failing at once
    groups = [FakeGroup([], start_error=ResourcesUnavailableError("no room")), FakeGroup([GroupPoll(finished=True)])]
    controller, made = _controller(groups, max_failures=1)
    while not controller.step().is_terminal:
        pass
    assert controller.state is RunState.FINISHED and len(made) == 2 and controller.failures == 1


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
