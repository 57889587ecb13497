"""RayWorkerGroup at many ranks: one collect per relay per heartbeat round through the node relays
([Note: node relays] in rayzero/workers/relay.py; a relay per node of 8, or per 8 single-rank nodes:
[Note: relays for small nodes]), and a poll whose work is linear in the ranks ([Note: per-rank calls]
in worker_group.py).

The real group code, on the shared local Ray, against bench/scale_sim.py's `RankHost` actors, each
hosting many simulated ranks (whole nodes of 8) that report once per simulated step, all together (as
ranks of one data-parallel step do). The last rank runs alone in its own process, and its node is
relayed by a real `NodeRelay` actor that asks its ranks over Ray, so that rank can be stopped
(SIGSTOP) or killed (SIGKILL) behind a live relay.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from bench import scale_sim
from bench.scale_sim import HostedRayWorkerGroup
from rayzero.controller.failures import FailureKind
from rayzero.workers.boundary import BoundaryRequest

pytestmark = pytest.mark.ray

RANKS = 96  # 12 nodes of 8


class CountingDict(dict):
    """A dict that counts the entries anyone iterated over (lookups by key are not counted)."""

    looked_at = 0

    def _count(self, items):
        for item in items:
            self.looked_at += 1
            yield item

    def __iter__(self):
        return self._count(super().__iter__())

    def keys(self):
        return self._count(super().keys())

    def values(self):
        return self._count(super().values())

    def items(self):
        return self._count(super().items())


def _take_rounds(group, rounds: int, seen: dict[int, list[int]]) -> list[dict]:
    """`rounds` heartbeat rounds, each followed by the poll that hands out their reports; each rank's
    report steps appended to `seen`. Returns each round's heartbeats."""
    beats = []
    for _ in range(rounds):
        round_beats, failures = group.heartbeats(2.0)
        assert not failures, failures
        polled = group.poll(0.0)
        assert not polled.failures, polled.failures
        for report in polled.reports:
            seen.setdefault(report.rank, []).append(report.seq)
        beats.append(round_beats)
    return beats


def _poll_until(group, seen: dict[int, list[int]], done, looked=None):
    """Polls until `done(poll)` (at most 20), each rank's report steps appended to `seen`; with
    `looked` (a CountingDict and a list), the run() entries each poll looked at appended to the list."""
    for _ in range(20):
        before = looked[0].looked_at if looked else 0
        polled = group.poll(2.0)
        if looked:
            looked[1].append(looked[0].looked_at - before)
        for report in polled.reports:
            seen.setdefault(report.rank, []).append(report.seq)
        if done(polled):
            break
    return polled


def _in_order_without_gaps(seen: dict[int, list[int]]) -> bool:
    return all(steps == list(range(steps[0], steps[0] + len(steps))) for steps in seen.values())


@contextlib.contextmanager
def _running_group(runs: CountingDict | None = None, ranks_per_node: int = 8):
    """A started group of RANKS hosted ranks, launched (into `runs` when given), rounds taken until
    every rank has reported twice (at least two): yields it and each rank's report steps so far."""
    group = HostedRayWorkerGroup(RANKS, hosts=2, step_time_s=0.3, ranks_per_node=ranks_per_node)
    group.start()
    try:
        if runs is not None:
            group._run_refs = runs  # as launch() fills it
        group.launch(lambda: None, None)
        seen: dict[int, list[int]] = {}
        _take_rounds(group, 2, seen)
        for _ in range(20):  # under load two rounds can come within one simulated step (make test here)
            if all(len(seen.get(rank, ())) >= 2 for rank in range(RANKS)):
                break
            _take_rounds(group, 1, seen)
        yield group, seen
    finally:
        group.shutdown()


@pytest.mark.timeout(240)
def test_a_round_makes_one_call_per_node_and_a_stopped_rank_holds_back_no_other(local_ray):
    with _running_group() as (group, seen):
        scale_sim.CALLS.clear()
        beats = _take_rounds(group, 3, seen)
        # one collect per node per round, whatever the ranks per node; every rank heard in every round
        assert scale_sim.CALLS["collect"] == 3 * RANKS // 8, scale_sim.CALLS
        assert all(all(beat is not None for beat in round_beats.values()) for round_beats in beats)
        assert sorted(seen) == list(range(RANKS)) and _in_order_without_gaps(seen), seen

        os.kill(group.victim_pid, signal.SIGSTOP)  # the rank's process stops; its node's relay does not
        try:
            stopped = _take_rounds(group, 2, seen)
        finally:
            os.kill(group.victim_pid, signal.SIGCONT)
        for round_beats in stopped:  # silent: absent from the round; its node-mates are not held back
            assert round_beats[group.victim_rank] is None
            assert all(beat is not None for rank, beat in round_beats.items() if rank != group.victim_rank)
        back = _take_rounds(group, 3, seen)
        assert back[-1][group.victim_rank] is not None  # heard again, and nothing it reported was lost
        assert _in_order_without_gaps(seen), {rank: seen[rank] for rank in (group.victim_rank, 0)}


@pytest.mark.timeout(240)
def test_single_rank_nodes_share_relays_one_call_per_eight_ranks(local_ray):
    """[Note: relays for small nodes]: with one rank per node a relay per node saved the controller
    nothing (96 calls a round here); relays of 8 single-rank nodes make it 12, as nodes of 8 do."""
    with _running_group(ranks_per_node=1) as (group, seen):
        scale_sim.CALLS.clear()
        beats = _take_rounds(group, 3, seen)
        assert scale_sim.CALLS["collect"] == 3 * RANKS // 8, scale_sim.CALLS
        assert all(all(beat is not None for beat in round_beats.values()) for round_beats in beats)
        assert {beat.node_id for beat in beats[-1].values()} == {scale_sim.node_of(rank, 1) for rank in range(RANKS)}
        assert sorted(seen) == list(range(RANKS)) and _in_order_without_gaps(seen), seen


@pytest.mark.timeout(240)
def test_a_killed_rank_is_a_failure_and_the_survivors_reports_are_kept(local_ray):
    with _running_group() as (group, seen):
        os.kill(group.victim_pid, signal.SIGKILL)
        polled = _poll_until(group, seen, lambda polled: polled.failures)
        assert [f.rank for f in polled.failures] == [group.victim_rank], polled.failures
        assert polled.failures[0].kind is FailureKind.WORKER_DIED
        # the survivors' reports up to the failure reached the caller, in order
        assert _in_order_without_gaps(seen) and all(len(seen[rank]) >= 2 for rank in range(RANKS - 1))


@pytest.mark.timeout(240)
def test_a_planned_stop_goes_out_once_per_node_and_the_last_reports_come_with_the_finish(local_ray):
    runs = CountingDict()
    with _running_group(runs) as (group, seen):
        scale_sim.CALLS.clear()
        group.request_boundary(1, BoundaryRequest.STOP)  # every rank saves at the next step and ends
        assert scale_sim.CALLS["request_boundary"] == RANKS // 8
        looked = []  # per poll: the run() entries it looked at
        polled = _poll_until(group, seen, lambda polled: polled.finished or polled.failures, (runs, looked))
        assert polled.finished and polled.stopped, polled.failures
        assert max(looked) <= 2 * RANKS, looked  # one pass over the run() calls per poll, not one per rank
        # every rank's reports up to the step it stopped at came with the finish, in order
        beats, _ = group.heartbeats(2.0)
        assert all(beat is not None and beat.finished for beat in beats.values())
        assert {rank: steps[-1] for rank, steps in seen.items()} == {
            rank: beat.handled.step for rank, beat in beats.items()}
        assert _in_order_without_gaps(seen) and group.poll(0.0).reports == []


@pytest.mark.timeout(240)
def test_a_dead_relay_is_a_failure_and_its_ranks_last_reports_still_come(local_ray):
    """[Note: relays for small nodes]: a relay is never a point of loss. Its death fails the attempt
    (its node most likely went with it), and its ranks are asked by the controller itself from then
    on, so what they reported since the relay's last answer comes before the group goes down (before,
    a dead relay's ranks were never asked again: a relay of several single-rank nodes took the last
    reports of every surviving node it gathered)."""
    import ray

    with _running_group() as (group, seen):
        rounds = group._rounds
        index = rounds.relay_of[group.victim_rank]
        relayed = rounds.ranks[index]
        before = {rank: len(seen[rank]) for rank in relayed}
        ray.kill(group.victim_relay)  # between rounds: no call of it in flight
        time.sleep(1.0)  # every rank reports meanwhile (a step is 0.3 s): something to lose
        for _ in range(10):
            group.heartbeats(2.0)
            polled = group.poll(0.0)
            for report in polled.reports:
                seen.setdefault(report.rank, []).append(report.seq)
            if polled.failures:
                break
        assert [(failure.kind, failure.rank) for failure in polled.failures] == [
            (FailureKind.WORKER_DIED, relayed[0])], polled.failures
        assert f"the relay on node {rounds.node_ids[index]}" in polled.failures[0].message
        # the survivors' last words: each of the dead relay's ranks reported since, in order, none lost
        assert all(len(seen[rank]) > before[rank] for rank in relayed), (before, {r: seen[r] for r in relayed})
        assert _in_order_without_gaps(seen)
