"""The controller's side of the node relays ([Note: node relays] in rayzero/workers/relay.py).

`RelayRounds` makes one `collect` call per relay per round and keeps what the answers bring —
heartbeats, reports in order, deaths — until the worker group hands them out (`heartbeats()` the
heartbeats, `poll()` the reports). It never holds two collects to one relay at once: a relay that
did not answer in time keeps its call, and its answer is taken in a later round, in order.
`relay_groups` decides which ranks each relay gathers ([Note: relays for small nodes]).

[Note: relays for small nodes]
A relay saves the controller a call per rank it gathers, less one: a relay per node saves nothing
where each node runs one rank (CPU workers, one-GPU nodes), and the controller was back at a Ray
call per rank per round (~0.25 ms of its CPU each; bench/scale.py's `small_nodes`: 5.2 cores at
4,096 single-rank nodes, 0.58 with these relays). So a relay gathers at least `RANKS_PER_RELAY` ranks: the nodes of one host (its
node IP) go to one relay, and hosts with fewer ranks are packed together, in rank order, until a
relay has that many (what is left at the end joins the last relay). Nodes of 8 GPUs keep a relay
each; 4,096 single-rank nodes get 512 relays, one call per 8 ranks, as with 8-GPU nodes. A relay
runs on the node of its group with the most ranks; its calls to the group's other nodes cross the
network, as the controller's own calls did. The relay is an optimisation, never a point of loss: if
one dies (most likely with its node, which the failure says), the controller gathers its ranks
itself from then on, so the survivors' last reports still reach it before the group goes down.

[Note: one node, no relay actor]
A relay gathers ranks so that the controller makes one call per relay, not per rank. A group whose
ranks all go to one relay (one node, or a few small ones: [Note: relays for small nodes]) has
nothing to gather across, so it gets no relay actor: the controller keeps that `NodeRelay` in its
own process and calls it in place (the same code, so the same order, silence and death rules). An
attempt then starts one process fewer (a Ray worker: ~0.6 CPU-s and its start-up), which is most
runs' case — one machine — and most restarts'. The round waits as long as for a remote relay:
`collect` waits `RELAY_WAIT_S` for the ranks either way; a last round's two waits (a fresh ask after
the first answers) share its time, where a remote relay's answer may come in a later round instead.
Groups of two relays or more get one relay actor each.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import ray

from rayzero.controller.failures import Failure, FailureKind
from rayzero.controller.health import rank_ranges
from rayzero.workers.boundary import Heartbeat
from rayzero.workers.relay import RELAY_WAIT_S, NodeRelay, NodeRound, ray_values
from rayzero.workers.session import Report

RANKS_PER_RELAY = 8
"""The fewest ranks a relay gathers where nodes are smaller ([Note: relays for small nodes])."""


@dataclass(frozen=True)
class RelayGroup:
    """The ranks one relay gathers, on which nodes, and where the relay runs."""

    home: str
    """The node the relay runs on: the group's node with the most ranks (the first of those)."""
    nodes: tuple[str, ...]
    ranks: tuple[int, ...]
    """The home node's ranks first (a failure of the relay blames the first), then the others', in order."""


def relay_groups(where: list[tuple[str, str]], per_relay: int = RANKS_PER_RELAY) -> list[RelayGroup]:
    """Which ranks each relay gathers ([Note: relays for small nodes]); `where[rank]` is the rank's
    (node id, node IP). Each host's nodes whole, hosts packed in rank order until a relay has
    `per_relay` ranks; a short remainder joins the last relay."""
    hosts: dict[str, dict[str, list[int]]] = {}  # IP -> node -> ranks, hosts and nodes in rank order
    for rank, (node, address) in enumerate(where):
        hosts.setdefault(address, {}).setdefault(node, []).append(rank)
    packed: list[dict[str, list[int]]] = []
    current: dict[str, list[int]] = {}
    for nodes in hosts.values():
        current.update(nodes)
        if sum(map(len, current.values())) >= per_relay:
            packed.append(current)
            current = {}
    if current:
        if packed:
            packed[-1].update(current)
        else:
            packed.append(current)
    groups = []
    for nodes in packed:
        home = max(nodes, key=lambda node: len(nodes[node]))
        others = sorted(rank for node, ranks in nodes.items() if node != home for rank in ranks)
        groups.append(RelayGroup(home, tuple(nodes), (*nodes[home], *others)))
    return groups


class RelayRounds:
    """One relay handle per group of ranks, the ranks each relays, and what their answers brought so far."""

    def __init__(self, relays: list[Any], ranks: list[list[int]], node_ids: list[str],
                 gather_here: Callable[[int], NodeRelay] | None = None) -> None:
        self.relays = relays  # NodeRelay handles (bench/scale_sim.py: stand-ins in its rank hosts)
        self.ranks = ranks  # per relay, the ranks it gathers
        self.node_ids = node_ids  # per relay, the node it runs on
        # relay index -> an in-process NodeRelay for its ranks, once it died ([Note: relays for small
        # nodes]); without it a dead relay's ranks are not asked again
        self._gather_here = gather_here
        self.relay_of = {rank: index for index, relay_ranks in enumerate(ranks) for rank in relay_ranks}
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
        here = [index for index in chosen if isinstance(self.relays[index], NodeRelay)]
        for index in chosen:  # the relay actors first: they gather while this process does its own
            if index not in self._calls and not isinstance(self.relays[index], NodeRelay):
                self._calls[index] = self.relays[index].collect.remote(wait_s, last, grace_s)
        for index in here:  # in this process ([Note: one node, no relay actor]; a dead relay's ranks)
            self._take(self.relays[index].collect(max(RELAY_WAIT_S, wait_s / 2) if last else wait_s, last, grace_s))
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
                self._failures.append(Failure(
                    FailureKind.WORKER_DIED,
                    f"the relay on node {self.node_ids[index]} (ranks {rank_ranges(self.ranks[index])}) died, "
                    f"most likely with its node: {value}", self.ranks[index][0]))
                if self._gather_here is not None:  # its ranks are asked from here on: no report is lost
                    self.relays[index] = self._gather_here(index)
                else:
                    self._dead.add(index)
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
