"""The controller's state machine, driven one step() at a time with a fake worker group (no Ray)."""
from __future__ import annotations

import pickle

import pytest

from rayzero.checkpoint.manifest import Manifest, commit
from rayzero.config.errors import RayZeroRuntimeError, RayZeroValueError
from rayzero.controller.controller import Controller, ControllerSettings
from rayzero.controller.elastic import BatchPlan, plan_batches
from rayzero.controller.errors import ResourcesUnavailableError, TrainingFailedError
from rayzero.controller.failures import Failure, FailureKind, FailurePolicy
from rayzero.controller.health import HangPolicy, find_hang
from rayzero.controller.requests import ControlRequest, RequestKind
from rayzero.controller.states import RunState
from rayzero.controller.status import CheckpointRecord
from rayzero.controller.worker_group import GroupPoll, assign_ranks
from rayzero.workers.actor import NodeInfo
from rayzero.workers.boundary import BoundaryRequest, HandledRequest, Heartbeat
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

    def shutdown(self, until_free: bool = False) -> None:
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


# ---- planned stops, resizes, control requests, hangs (fake group, fake clock) ----------------

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _beat(rank: int, step: int, age: float = 0.0, handled=None, stepped: bool = True, saving: bool = False,
          step_time: float | None = 0.1) -> Heartbeat:
    return Heartbeat(rank, f"node{rank}", step, step, age, stepped, saving, step_time, 1 << 20, 1 << 20,
                     handled, False)


def _running(controller: Controller) -> None:
    while controller.state is not RunState.RUNNING:
        controller.step()


def test_stop_drains_at_the_agreed_boundary_then_finishes_stopped(tmp_path):
    _commit(tmp_path, 4)
    group = FakeGroup([GroupPoll(), GroupPoll(), GroupPoll(finished=True, stopped=True)])
    controller, _ = _controller([group], settings=ControllerSettings(checkpoint_locations=(str(tmp_path),)))
    _running(controller)
    request = controller.submit(ControlRequest(RequestKind.STOP))
    assert controller.step() is RunState.DRAINING
    assert group.requests == [(request.request_id, int(BoundaryRequest.STOP))]
    while not controller.step().is_terminal:
        pass
    assert controller.state is RunState.FINISHED and controller.stopped and controller.failures == 0
    assert request.wait(1).step == 4 and controller.take_update().stopped


def test_checkpoint_now_resolves_once_every_rank_committed_and_fails_when_not_running(tmp_path):
    location = _commit(tmp_path, 6)
    handled = HandledRequest(0, int(BoundaryRequest.CHECKPOINT), 6, location)
    group = FakeGroup([GroupPoll()] * 4, beats=[
        {0: _beat(0, 5), 1: _beat(1, 5)},
        {0: _beat(0, 6, handled=handled), 1: _beat(1, 6)},  # rank 1 not yet: keep waiting
        {0: _beat(0, 6, handled=handled), 1: _beat(1, 6, handled=handled)},
    ])
    clock = Clock()
    controller, _ = _controller([group], clock=clock, plan=BatchPlan(2, 2, None))
    early = controller.submit(ControlRequest(RequestKind.CHECKPOINT))
    controller.step()
    with pytest.raises(RayZeroRuntimeError, match="not running"):
        early.wait(0)
    _running(controller)
    request = controller.submit(ControlRequest(RequestKind.CHECKPOINT))
    object.__setattr__(handled, "request_id", request.request_id)
    for _ in range(3):
        clock.now += 2
        controller.step()
        if request.done:
            break
    assert group.requests == [(request.request_id, int(BoundaryRequest.CHECKPOINT))]
    assert request.wait(0) == CheckpointRecord("durable", location, 6, request.result.time)
    assert controller.state is RunState.RUNNING


def test_scale_resizes_through_a_planned_stop_without_charging_the_budget(tmp_path):
    _commit(tmp_path, 9)
    first = FakeGroup([GroupPoll(), GroupPoll(finished=True, stopped=True)])
    second = FakeGroup([GroupPoll(finished=True)])
    plan = plan_batches({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2}, 1, 3)
    controller, made = _controller([first, second], plan=plan,
                                   settings=ControllerSettings(checkpoint_locations=(str(tmp_path),)))
    _running(controller)
    assert first.workers == 3  # capacity unknown: the largest valid size
    with pytest.raises(RayZeroValueError, match="elastic range is 1:3"):
        controller.submit(ControlRequest(RequestKind.SCALE, workers=4))
    controller.submit(ControlRequest(RequestKind.SCALE, workers=2))
    seen = [controller.step() for _ in range(4)]
    assert RunState.RESIZING in seen and second.workers == 2
    assert made == [(0, None), (1, str(tmp_path))] and controller.failures == 0
    while not controller.step().is_terminal:
        pass
    assert controller.state is RunState.FINISHED and not controller.stopped


def test_grows_back_when_room_returns_and_restarts_with_what_fits_after_a_failure(tmp_path):
    free = {"slots": 1}
    clock = Clock()
    died = GroupPoll(failures=[Failure(FailureKind.WORKER_DIED, "node lost", 2)])
    groups = [FakeGroup([died]), FakeGroup([GroupPoll()] * 3 + [GroupPoll(finished=True, stopped=True)]),
              FakeGroup([GroupPoll(finished=True)])]
    plan = plan_batches({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2}, 2, 3)
    controller, made = _controller(groups, max_failures=1, plan=plan, clock=clock,
                                   capacity=lambda: free["slots"] if controller.world_size else free["slots"] + 0,
                                   settings=ControllerSettings(grow_interval_s=5.0))
    free["slots"] = 3
    _running(controller)
    assert groups[0].workers == 3
    free["slots"] = 2  # after the loss only two fit: restart with two, not wait for three
    while controller.state is not RunState.RUNNING or controller.attempt == 0:
        controller.step()
    assert groups[1].workers == 2 and controller.failures == 1
    free["slots"] = 0
    clock.now += 6
    controller.step()
    assert controller.state is RunState.RUNNING  # no room: no resize
    free["slots"] = 1  # the node is back: 2 + 1 fit
    clock.now += 6
    controller.step()
    assert controller.state is RunState.RESIZING
    while not controller.step().is_terminal:
        pass
    assert groups[2].workers == 3 and controller.failures == 1 and len(made) == 3


def test_a_size_that_does_not_place_falls_back_to_the_next_valid_one_without_a_failure():
    plan = plan_batches({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3}, 1, 3)
    assert plan.valid_sizes() == [1, 2] and "3 workers" in plan.skipped[3]  # 12 = 3 x 3 x gas: no
    groups = [FakeGroup([], start_error=ResourcesUnavailableError("2 did not fit")), FakeGroup([GroupPoll(finished=True)])]
    controller, _ = _controller(groups, plan=plan)
    while not controller.step().is_terminal:
        pass
    assert [g.workers for g in groups] == [2, 1] and controller.failures == 0
    assert controller.state is RunState.FINISHED


def test_a_hung_rank_is_named_with_every_ranks_stacks_and_restarted():
    clock = Clock()
    hung = FakeGroup([GroupPoll()] * 5, beats=[
        {0: _beat(0, 7, age=1), 1: _beat(1, 7, age=1)},
        {0: _beat(0, 7, age=40), 1: _beat(1, 7, age=45, saving=True)},  # saving is progress
        {0: _beat(0, 7, age=61), 1: _beat(1, 7, age=66)},
    ])
    controller, _ = _controller([hung, FakeGroup([GroupPoll(finished=True)])], max_failures=1, clock=clock,
                                       plan=BatchPlan(2, 2, None))
    _running(controller)
    for _ in range(3):
        clock.now += 2
        controller.step()
    assert controller.state is RunState.RESTARTING and controller.failures == 1
    line = next(e for e in controller.take_update().events if "hang" in e)
    assert "rank 1 made no progress for 66s at step 7 (micro step 7, outside" in line and "limit 55s" in line


def test_a_hang_past_the_budget_errors_naming_the_rank_with_stacks():
    clock = Clock()
    hung = FakeGroup([GroupPoll()] * 3, beats=[{0: _beat(0, 3, age=70, step_time=8.0), 1: _beat(1, 2, age=50)},
                                               {0: _beat(0, 3, age=81, step_time=8.0), 1: _beat(1, 2, age=90)}])
    controller, _ = _controller([hung], clock=clock, plan=BatchPlan(2, 2, None))
    _running(controller)
    clock.now += 2
    controller.step()
    assert controller.state is RunState.RUNNING  # adaptive: rank 0's limit is 10 x 8 s
    clock.now += 2
    controller.step()
    assert controller.state is RunState.ERRORED and controller.error.rank == 1  # behind: step 2
    assert "time.sleep(3600)" in str(controller.error) and "rank 0 Python stacks" in str(controller.error)


def test_find_hang_uses_the_start_up_grace_before_the_first_step():
    policy = HangPolicy(hang_timeout_s=60, startup_grace_s=300)
    assert find_hang({0: _beat(0, 0, age=200, stepped=False)}, {}, policy) is None
    assert find_hang({0: _beat(0, 0, age=301, stepped=False)}, {}, policy).culprit == 0
    assert find_hang({0: None, 1: _beat(1, 4, age=1)}, {0: 400.0, 1: 0.0}, policy).culprit == 0  # silent rank
    assert find_hang({0: _beat(0, 4, age=99)}, {}, HangPolicy(hang_timeout_s=0)) is None  # disabled


def test_kill_ends_the_run_at_once_and_backoff_doubles():
    group = FakeGroup([GroupPoll()] * 3)
    controller, _ = _controller([group])
    _running(controller)
    controller.submit(ControlRequest(RequestKind.KILL, reason="operator said so"))
    assert controller.step() is RunState.ERRORED and "operator said so" in str(controller.error)
    assert group.calls[-1] == "shutdown"
    policy = FailurePolicy(5, backoff_s=2.0)
    assert [policy.backoff(n) for n in (1, 2, 3, 7)] == [2.0, 4.0, 8.0, 60.0]


def test_the_backoff_doubles_for_failures_in_a_row_and_starts_again_after_a_new_checkpoint(tmp_path):
    # before: the exponent counted every failure of the run, so a long run's seventh failure, however
    # far apart from the sixth, waited 60 s
    clock = Clock()
    died = GroupPoll(failures=[Failure(FailureKind.WORKER_DIED, "died", 0)])
    groups = [FakeGroup([died]) for _ in range(4)] + [FakeGroup([GroupPoll(finished=True)])]
    made: list[int] = []

    def factory(attempt: int, resume_from: str | None, workers: int) -> FakeGroup:
        made.append(attempt)
        return groups[attempt]

    controller = Controller(factory, lambda: None, None, FailurePolicy(-1, backoff_s=1.0, max_failures_without_progress=0),
                            clock=clock, settings=ControllerSettings(checkpoint_locations=(str(tmp_path),)))
    waits = []
    for attempt, commits_before_failing in enumerate((None, None, 5, None)):
        _running(controller)
        if commits_before_failing is not None:
            _commit(tmp_path, commits_before_failing)
        controller.step()
        assert controller.state is RunState.RESTARTING, controller.state
        waits.append(controller.current.not_before - clock.now)
        clock.now = controller.current.not_before
    while not controller.step().is_terminal:
        pass
    # two in a row double; the checkpoint of step 5 starts the count again; the next one in a row doubles
    assert waits == [1.0, 2.0, 1.0, 2.0] and made == [0, 1, 2, 3, 4] and controller.failures == 4


def test_a_drain_notice_on_a_ranks_node_checkpoints_and_regroups_without_it(tmp_path):
    _commit(tmp_path, 5)
    clock = Clock()
    draining: set[str] = set()
    first = FakeGroup([GroupPoll()] * 3 + [GroupPoll(finished=True, stopped=True)],
                      beats=[{r: _beat(r, 5) for r in range(3)}] * 3)
    second = FakeGroup([GroupPoll(finished=True)])
    plan = plan_batches({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2}, 1, 3)
    controller, made = _controller([first, second], plan=plan, clock=clock, draining=lambda: draining,
                                   settings=ControllerSettings(checkpoint_locations=(str(tmp_path),)))
    _running(controller)
    clock.now += 2
    controller.step()
    assert controller.state is RunState.RUNNING
    draining.add("node2")  # rank 2's node
    clock.now += 2
    controller.step()
    assert controller.state is RunState.RESIZING and first.requests[-1][1] == int(BoundaryRequest.STOP)
    while not controller.step().is_terminal:
        pass
    assert second.workers == 2 and made[1] == (1, str(tmp_path)) and controller.failures == 0


def test_the_culprit_is_the_rank_outside_the_step_the_others_wait_in():
    import dataclasses

    waiting = dataclasses.replace(_beat(0, 4, age=3.3), in_step=True)  # blocked in a collective
    sleeping = dataclasses.replace(_beat(1, 4, age=3.1), in_step=False)  # in user code between steps
    hang = find_hang({0: waiting, 1: sleeping}, {}, HangPolicy(hang_timeout_s=3))
    assert hang.culprit == 1 and "outside an engine step" in hang.reason


def test_a_checkpoint_interval_makes_the_controller_ask_for_checkpoints_one_at_a_time():
    """[Note: a checkpoint interval from the numbers]: once the interval has passed since the newest
    checkpoint (or the attempt's start) the ranks are asked to checkpoint at the boundary; not again
    while that one is on its way."""
    beats = [{0: _beat(0, step), 1: _beat(1, step)} for step in range(1, 6)]
    group = FakeGroup([GroupPoll()] * 6, beats=beats)
    clock = Clock()
    controller, _ = _controller([group], clock=clock, plan=BatchPlan(2, 2, None),
                                settings=ControllerSettings(checkpoint_interval=1e-6))
    _running(controller)
    for _ in range(4):
        clock.now += 2
        controller.step()
    assert [kind for _, kind in group.requests] == [int(BoundaryRequest.CHECKPOINT)]  # one, pending
    from rayzero.controller.status_view import run_status

    assert run_status(controller, "run", 0.0).extra["checkpoint_interval_s"] == "0"  # status shows the interval


def test_the_auto_interval_counts_the_runs_earlier_calls_failures_and_a_killed_driver():
    """[Note: a checkpoint interval from the numbers]: a call's updates carry its failure record beside
    the goodput figures (the driver writes them to `<run>/goodput.json`); a rerun's controller reads it
    back: the failures it saw count, and so does the call itself when it never said it ended."""
    import json

    died = GroupPoll(failures=[Failure(FailureKind.WORKER_DIED, "rank 0's worker died", 0)])
    first, _ = _controller([FakeGroup([died]), FakeGroup([GroupPoll()] * 4)], max_failures=1,
                           settings=ControllerSettings(checkpoint_interval="auto"))
    while first.failures == 0 or first.state is not RunState.RUNNING:
        first.step()
    killed = json.loads(json.dumps(first.take_update().goodput))  # the driver is SIGKILLed after this write
    assert killed["checkpoint_interval"] == {"failures": 1, "save_stall_s": None, "running": True}
    rerun, _ = _controller([FakeGroup([GroupPoll(finished=True)])],
                           settings=ControllerSettings(checkpoint_interval="auto", goodput_before=killed))
    assert rerun.interval.earlier_failures == 2  # the worker that died, and the killed driver
    from rayzero.controller.status_view import run_status

    assert "2 failure(s)" in run_status(rerun, "run", 0.0).extra["checkpoint_interval_inputs"]
    while not rerun.step().is_terminal:
        pass
    ended = rerun.take_update().goodput["checkpoint_interval"]
    assert ended == {"failures": 2, "save_stall_s": None, "running": False}  # a next rerun counts none more
