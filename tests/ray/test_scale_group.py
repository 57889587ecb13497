"""RayWorkerGroup's own work per poll is linear in the ranks ([Note: per-rank calls] in worker_group.py).

The real group code, on the shared local Ray, against bench/scale_sim.py's `RankHost` actors, each
hosting many simulated ranks that report once per simulated step, all together (as ranks of one
data-parallel step do). The outstanding-call tables count the entries the group looks at.
"""
from __future__ import annotations

import pytest

from bench.scale_sim import HostedRayWorkerGroup
from rayzero.workers.boundary import BoundaryRequest

pytestmark = pytest.mark.ray


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


@pytest.mark.timeout(240)
def test_a_poll_many_ranks_answer_and_the_planned_stop_look_at_each_call_a_bounded_number_of_times(local_ray):
    ranks = 96
    group = HostedRayWorkerGroup(ranks, hosts=2, step_time_s=0.5)
    group.start()
    try:
        polls, calls = CountingDict(), CountingDict()
        group._poll_refs, group._run_refs = polls, calls  # as launch() fills them
        group.launch(lambda: None, None)
        seen: list[tuple[int, int]] = []  # per poll: (reports it brought, entries looked at)
        reports = 0
        while reports < 4 * ranks:
            before = polls.looked_at + calls.looked_at
            polled = group.poll(2.0)
            assert not polled.failures, polled.failures
            reports += len(polled.reports)
            seen.append((len(polled.reports), polls.looked_at + calls.looked_at - before))
        busy = [looked for brought, looked in seen if brought >= 16]
        assert busy, seen  # some polls brought many ranks' reports at once
        # one pass over each table per poll (4 x ranks); was also one scan per answering rank
        assert max(busy) <= 5 * ranks, seen

        group.request_boundary(1, BoundaryRequest.STOP)  # every rank saves at the next step and ends
        for _ in range(20):
            before = polls.looked_at + calls.looked_at
            polled = group.poll(2.0)
            assert not polled.failures, polled.failures
            if polled.finished:
                break
        assert polled.finished and polled.stopped
        # every rank finished in this poll: their last reports were collected without a scan per rank
        assert polls.looked_at + calls.looked_at - before <= 5 * ranks
    finally:
        group.shutdown()
