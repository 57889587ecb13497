"""One relay per node (or per group of small nodes): its ranks' heartbeats and reports gathered
there, one call to the controller.

[Note: node relays]
The controller hears from every rank once per heartbeat round: the rank's `Heartbeat` (hangs,
stragglers, the planned-stop handshake, checkpoints its disk holds) and the `Report`s its loop made
since (metrics, status, goodput). One Ray call per rank costs the caller about 0.25 ms of CPU in
Ray's submission path alone (bench/scale.py: profiled, most of it `submit_actor_task`), so with a
call per rank per round for heartbeats and another per rank for reports, the controller spent about
two cores on calls at 4,096 ranks. A `NodeRelay` actor on each node instead asks its node's ranks
(`TrainWorker.collect`: the heartbeat and the queued reports in one answer) and hands the controller
the whole node in one `NodeRound`: one call per node per round (a 16th of the two calls per rank at 8
ranks a node) and the node's calls stay on the node. Nodes of fewer ranks share a relay, so each
gathers at least 8 ([Note: relays for small nodes] in rayzero/controller/relay_rounds.py).

What the protocol keeps:
- Order: the controller has at most one `collect` outstanding per relay, a relay at most one call
  outstanding per rank, and a rank's answer drains its queue; so each rank's reports arrive in order.
- Silence: a relay waits at most `wait_s` for its ranks, so one stopped rank delays neither the
  node's other ranks nor the round; the stopped rank's call stays outstanding (it is not asked twice)
  and it is simply absent from the round's heartbeats, which is what hang detection counts.
- Death: the controller still holds every rank's `run()` call and learns of a death from it at once;
  a relay reports a rank whose call failed too, and the relay's own death (its node is gone) fails
  the controller's call; the controller then asks that relay's ranks itself.
- The last reports: `fresh` makes the relay ask again every rank whose answer came from a call made
  before this collect, so after a rank's loop returned, one fresh collect holds everything it reported.
Requests for the step boundary go out through the relays too (one call per node); stacks for a hang
report are asked of every rank directly (once per hang, and they must reach a rank behind a wedged relay).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray

from rayzero.workers.boundary import Heartbeat
from rayzero.workers.heap import TRIM_INTERVAL_S, release_free_heap
from rayzero.workers.session import Report

RELAY_WAIT_S = 0.25
"""How long a relay waits for its ranks' answers in one collect. A rank's answer takes milliseconds;
a later one is taken at the next round, so a silent rank holds the controller's round this long."""


@dataclass(frozen=True)
class NodeRound:
    """What one node's ranks said since the previous collect."""

    node_id: str
    heartbeats: dict[int, Heartbeat] = field(default_factory=dict)
    """The ranks that answered (a rank before its setup has none)."""
    reports: list[Report] = field(default_factory=list)
    """Their reports, each rank's in order."""
    died: dict[int, str] = field(default_factory=dict)
    """Ranks whose worker died, with the error of the call."""


def ray_values(refs: list[Any]) -> list[Any]:
    """The values of finished calls, in order, each call that failed as its RayActorError: one
    `ray.get` for all of them while none failed (a get per call costs the caller ~0.07 ms)."""
    if not refs:
        return []
    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError:
        values: list[Any] = []
        for ref in refs:
            try:
                values.append(ray.get(ref))
            except ray.exceptions.RayActorError as error:
                values.append(error)
        return values


class NodeRelay:
    """A Ray actor on one node that gathers its ranks for the controller ([Note: node relays]), or,
    for a group on one node, an object the controller calls in place ([Note: one node, no relay
    actor] in rayzero/controller/relay_rounds.py). Single-threaded: collects never overlap, and a
    request waits at most one collect's `wait_s`."""

    def __init__(self, node_id: str, workers: dict[int, Any]) -> None:
        self._node_id = node_id
        self._workers = dict(workers)  # rank -> TrainWorker handle; a dead rank is dropped
        self._calls: dict[int, Any] = {}  # rank -> its outstanding collect() call
        self._trimmed_at = time.monotonic()  # when its free heap pages last went back to the system

    def ready(self) -> str:
        """Answers once the relay runs (the group waits for it with the workers' setup)."""
        return self._node_id

    def collect(self, wait_s: float = RELAY_WAIT_S, fresh: bool = False, grace_s: float = 0.0) -> NodeRound:
        """Every rank's heartbeat and reports that arrive within `wait_s`; with `fresh`, ranks whose
        answer came from a call made before this collect are asked once more. `grace_s`: how long a
        rank whose loop has not ended and has nothing queued waits for a report (`TrainWorker.collect`)."""
        out = NodeRound(self._node_id)
        if time.monotonic() - self._trimmed_at >= TRIM_INTERVAL_S:  # [Note: the allocator's free pages]
            release_free_heap()
            self._trimmed_at = time.monotonic()
        asked_now = self._ask(set(self._workers), grace_s)
        answered = self._take(wait_s, out)
        if fresh:
            again = self._ask(answered - asked_now, grace_s)
            if again:
                self._take(wait_s, out)
        return out

    def request_boundary(self, request_id: int, kind: int) -> None:
        """Forward a boundary request to every rank of the node (fire and forget: heartbeats answer)."""
        for worker in self._workers.values():
            worker.request_boundary.remote(request_id, kind)

    def _ask(self, ranks: set[int], grace_s: float) -> set[int]:
        """A collect() call to each of `ranks` that has none outstanding; returns the ranks asked."""
        asked = set()
        for rank in ranks:
            if rank not in self._calls and rank in self._workers:
                self._calls[rank] = self._workers[rank].collect.remote(grace_s)
                asked.add(rank)
        return asked

    def _take(self, wait_s: float, out: NodeRound) -> set[int]:
        """Wait up to `wait_s` for the outstanding calls; their answers into `out`, rank by rank."""
        if not self._calls:
            return set()
        refs = {ref: rank for rank, ref in self._calls.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
        answered = set()
        for ref, value in zip(ready, ray_values(ready)):
            rank = refs[ref]
            del self._calls[rank]
            answered.add(rank)
            if isinstance(value, ray.exceptions.RayActorError):
                out.died[rank] = str(value)
                del self._workers[rank]  # asking again would only fail again
                continue
            heartbeat, reports = value
            if heartbeat is not None:
                out.heartbeats[rank] = heartbeat
            out.reports.extend(reports)
        return answered
