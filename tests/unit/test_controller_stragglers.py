"""Straggler detection: the pure policy over one heartbeat round, and the controller reporting a rank that
stays slow for several rounds (driven one step() at a time through a fake worker group, no Ray)."""
from __future__ import annotations

import pytest

from rayzero.controller.controller import Controller
from rayzero.controller.elastic import BatchPlan
from rayzero.controller.failures import FailurePolicy
from rayzero.controller.health import StragglerPolicy, slow_ranks
from rayzero.controller.states import RunState
from rayzero.controller.worker_group import GroupPoll
from rayzero.workers.boundary import Heartbeat

pytestmark = pytest.mark.unit


def _beat(rank: int, loop_time: float | None, step_time: float = 0.5) -> Heartbeat:
    return Heartbeat(rank, f"node{rank}", 10, 10, 0.1, True, False, step_time, 1 << 20, 1 << 20, None, False,
                     loop_time_s=loop_time)


def test_a_rank_at_least_one_and_a_half_times_the_median_loop_time_is_slow():
    policy = StragglerPolicy()
    beats = {0: _beat(0, 0.10), 1: _beat(1, 0.11), 2: _beat(2, 0.40)}
    assert slow_ranks(beats, policy) == {2: (0.40, 0.11, 0.5)}
    # 1.4x is not slow; neither is 2x of a few microseconds (not a real share of the step)
    assert slow_ranks({0: _beat(0, 0.10), 1: _beat(1, 0.10), 2: _beat(2, 0.14)}, policy) == {}
    assert slow_ranks({0: _beat(0, 0.00001), 1: _beat(1, 0.00001), 2: _beat(2, 0.00003)}, policy) == {}
    # too early to tell (fewer than 3 steps measured), a single rank, no heartbeat
    assert slow_ranks({0: _beat(0, None), 1: _beat(1, 0.5)}, policy) == {}
    assert slow_ranks({0: None, 1: _beat(1, 0.5)}, policy) == {}


class _Group:
    """Always running; heartbeats played back round by round."""

    def __init__(self, rounds: list[dict[int, Heartbeat]]) -> None:
        self.rounds = rounds

    def start(self) -> dict[str, float]:
        return {}

    def launch(self, train_loop, loop_config) -> None:
        pass

    def poll(self, timeout_s: float) -> GroupPoll:
        return GroupPoll()

    def heartbeats(self, timeout_s: float):
        return (self.rounds.pop(0) if self.rounds else {}), []

    def shutdown(self, until_free: bool = False) -> None:
        pass


def test_the_controller_reports_a_rank_slow_for_three_rounds_in_a_row_once():
    slow = {0: _beat(0, 0.01), 1: _beat(1, 0.30)}
    fast = {0: _beat(0, 0.01), 1: _beat(1, 0.01)}
    group = _Group([slow, slow, fast, slow, slow, slow, slow, slow])  # a blip, then a streak
    ticks = iter(range(1000, 10_000, 2))  # each step() is a heartbeat round (1 s apart by default)
    controller = Controller(lambda attempt, resume, workers: group, lambda: None, None, FailurePolicy(0),
                            plan=BatchPlan(2, 2, None), clock=lambda: float(next(ticks)))
    while controller.state is not RunState.RUNNING:
        controller.step()
    for _ in range(8):
        controller.step()
    update = controller.take_update()
    assert [(s.rank, s.attempt) for s in update.stragglers] == [(1, 0)]
    found = update.stragglers[0]
    assert found.loop_time_s == 0.30 and found.median_loop_time_s == pytest.approx(0.155)
    lines = [line for line in update.events if line.startswith("straggler")]
    assert lines == [found.describe()] and "rank 1 (node node1)" in lines[0] and "1.9x the median" in lines[0]
