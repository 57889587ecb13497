"""The controller's side of the node relays ([Note: node relays] in rayzero/workers/relay.py).

`RelayRounds` makes one `collect` call per node per round and keeps what the answers bring —
heartbeats, reports in order, deaths — until the worker group hands them out (`heartbeats()` the
heartbeats, `poll()` the reports). It never holds two collects to one relay at once: a relay that
did not answer in time keeps its call, and its answer is taken in a later round, in order.

[Note: one node, no relay actor]
A relay gathers one node's ranks so that the controller makes one call per node, not per rank. A
group on one node has nothing to gather across, so it gets no relay actor: the controller keeps the
node's `NodeRelay` in its own process and calls it in place (the same code, so the same order,
silence and death rules). An attempt then starts one process fewer (a Ray worker: ~0.6 CPU-s and
its start-up), which is most runs' case — one machine — and most restarts'. The round waits as
long as for a remote relay: `collect` waits `RELAY_WAIT_S` for the ranks either way; a last round's
two waits (a fresh ask after the first answers) share its time, where a remote relay's answer may
come in a later round instead. Groups on two nodes or more keep one relay actor per node.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import ray

from rayzero.controller.failures import Failure, FailureKind
from rayzero.controller.health import rank_ranges
from rayzero.workers.boundary import Heartbeat
from rayzero.workers.relay import RELAY_WAIT_S, NodeRelay, NodeRound, ray_values
from rayzero.workers.session import Report


class RelayRounds:
    """One relay handle per node, the ranks each relays, and what their answers brought so far."""

    def __init__(self, relays: list[Any], ranks: list[list[int]], node_ids: list[str]) -> None:
        self.relays = relays  # NodeRelay handles (bench/scale_sim.py: stand-ins in its rank hosts)
        self.ranks = ranks  # per relay, the ranks of its node
        self.node_ids = node_ids
        self.relay_of = {rank: index for index, node_ranks in enumerate(ranks) for rank in node_ranks}
        self._calls: dict[int, Any] = {}  # relay index -> its outstanding collect() call
        self._dead: set[int] = set()  # relays whose call failed: not asked again
        self._reports: list[Report] = []
        self._heartbeats: dict[int, Heartbeat] = {}  # newest per rank since take_heartbeats()
        self._failures: list[Failure] = []

    def round(self, timeout_s: float, relays: Iterable[int] | None = None, last: bool = False,
              grace_s: float = 0.0) -> None:
        """Ask each relay (all, or `relays`) with no collect outstanding, then wait up to `timeout_s`
        for every outstanding one of them. `last`: the ranks' last words (their loops ended, or the
        group goes down): fresh answers ([Note: node relays]), each rank waited for as long as
        `timeout_s` allows, one whose loop has not ended given `grace_s` to report; the caller `settle`s the
        outstanding calls first."""
        chosen = [index for index in (range(len(self.relays)) if relays is None else relays)
                  if index not in self._dead]
        wait_s = max(RELAY_WAIT_S, timeout_s - 1.0) if last else RELAY_WAIT_S
        for index in chosen:
            relay = self.relays[index]
            if isinstance(relay, NodeRelay):  # in this process ([Note: one node, no relay actor])
                self._take(relay.collect(max(RELAY_WAIT_S, wait_s / 2) if last else wait_s, last, grace_s))
            elif index not in self._calls:
                self._calls[index] = relay.collect.remote(wait_s, last, grace_s)
        self._wait(chosen, timeout_s)

    def settle(self, relays: Iterable[int], timeout_s: float) -> None:
        """Wait up to `timeout_s` for the collects of `relays` already outstanding (none asked anew)."""
        self._wait([index for index in relays if index in self._calls], timeout_s)

    def _wait(self, chosen: list[int], timeout_s: float) -> None:
        refs = {self._calls[index]: index for index in chosen if index in self._calls}
        if not refs:
            return
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref, value in zip(ready, ray_values(ready)):
            index = refs[ref]
            del self._calls[index]
            if isinstance(value, ray.exceptions.RayActorError):  # ActorUnavailableError too
                self._dead.add(index)
                self._failures.append(Failure(
                    FailureKind.WORKER_DIED,
                    f"the relay of node {self.node_ids[index]} (ranks {rank_ranges(self.ranks[index])}) died, "
                    f"most likely with its node: {value}", self.ranks[index][0]))
            else:
                self._take(value)

    def _take(self, node_round: NodeRound) -> None:
        self._reports.extend(node_round.reports)
        self._heartbeats.update(node_round.heartbeats)
        for rank, error in sorted(node_round.died.items()):
            self._failures.append(Failure(FailureKind.WORKER_DIED, f"rank {rank}'s worker died: {error}", rank))

    def request_boundary(self, request_id: int, kind: int) -> None:
        for index, relay in enumerate(self.relays):
            if isinstance(relay, NodeRelay):
                relay.request_boundary(request_id, kind)  # its ranks' calls are fire and forget too
            elif index not in self._dead:
                relay.request_boundary.remote(request_id, kind)  # fire and forget: answered by heartbeats

    def take_reports(self) -> list[Report]:
        reports, self._reports = self._reports, []
        return reports

    def take_heartbeats(self) -> dict[int, Heartbeat]:
        beats, self._heartbeats = self._heartbeats, {}
        return beats

    def take_failures(self) -> list[Failure]:
        failures, self._failures = self._failures, []
        return failures

    @property
    def has_news(self) -> bool:
        """Reports or failures wait to be handed out (the group's poll then does not wait)."""
        return bool(self._reports or self._failures)
