"""Simulated workers for bench/scale.py: many light ranks that speak the controller's real protocol.

Two ways in, both driving the real `Controller` (rayzero/controller/controller.py):

- `SimulatedGroup`: a `WorkerGroup` of N ranks in this process, no Ray. Each round's reports
  (`rayzero.workers.session.Report`) and heartbeats (`rayzero.workers.boundary.Heartbeat`, with the
  planned-stop handshake's `HandledRequest`) are built by `advance()` *before* the controller's step
  is timed, so what is measured is the controller's own work per round.
- `HostedRayWorkerGroup`: the real `RayWorkerGroup` (its launch / poll / heartbeats /
  request_boundary / stacks / finish code: a run() call per rank, a collect call per node per round
  through `RelayRounds`, as with real workers) against a few async Ray actors (`RankHost`) that each
  host many simulated ranks, whole nodes of them, and answer for each of their nodes as its
  `NodeRelay` would (one process per node does not fit here). One rank sits alone in its own actor
  process so it can really be killed (SIGKILL) or stopped (SIGSTOP), and its node is relayed by a real
  `NodeRelay` actor, which asks that node's ranks over Ray as on a real node. Only `start()`
  (placement group, TrainWorker actors, process group) and `shutdown()` (one `ray.kill` per host
  instead of per rank) differ from the real group.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

import ray

from bench.scale_report import HANG_LIMIT_S
from rayzero.config.run_settings import ScalingConfig
from rayzero.controller.controller import Controller, ControllerSettings
from rayzero.controller.elastic import BatchPlan
from rayzero.controller.failures import Failure, FailureKind, FailurePolicy
from rayzero.controller.health import HangPolicy
from rayzero.controller.relay_rounds import RANKS_PER_RELAY, RelayRounds, relay_groups
from rayzero.controller.states import RunState
from rayzero.controller.worker_group import GroupPoll, RayWorkerGroup
from rayzero.workers.actor import NodeInfo, WorkerOutcome
from rayzero.workers.boundary import BoundaryRequest, HandledRequest, Heartbeat
from rayzero.workers.relay import NodeRelay, NodeRound
from rayzero.workers.session import Report

RANKS_PER_NODE = 8  # node ids as on 8-GPU nodes: rank r runs on node r // 8
STACK = ('Thread "MainThread" (140000000000000):\n  File "train.py", line 42, in train_loop\n'
         '    loss = engine(batch)\n  File "rayzero/engine/engine.py", line 310, in forward\n'
         '    work.wait()\n')  # what a rank blocked in a collective shows (a real dump is ~2-5 kB)


def node_of(rank: int, ranks_per_node: int = RANKS_PER_NODE) -> str:
    return f"node{rank // ranks_per_node:05d}"


def heartbeat(rank: int, step: int, progress_age_s: float, handled: HandledRequest | None = None,
              finished: bool = False, ranks_per_node: int = RANKS_PER_NODE) -> Heartbeat:
    return Heartbeat(rank=rank, node_id=node_of(rank, ranks_per_node), step=step, micro_step=step, progress_age_s=progress_age_s,
                     stepped=step > 0, saving=False, step_time_s=1.0 if step > 1 else None,
                     memory_bytes=40 << 30, host_memory_bytes=200 << 30, handled=handled, finished=finished,
                     in_step=True, loop_time_s=0.01 if step > 3 else None)


def report(rank: int, step: int, attempt: int = 0) -> Report:
    return Report(rank, step, time.time(), {"step": step, "loss": 1.0 / (1 + step), "samples": 8 * step},
                  None, 40 << 30, None, attempt, 1e-4)


class SimulatedGroup:
    """A WorkerGroup of `world_size` in-process ranks; `advance(now)` makes every live rank take a step."""

    def __init__(self, world_size: int, checkpoint_dir: str = "/nonexistent", realtime: bool = False) -> None:
        self.world_size = world_size
        # realtime: poll() waits (up to its timeout) for the next advance() as a real poll waits for
        # reports; otherwise it returns at once (the controller is stepped by hand on a simulated clock)
        self._stepped = threading.Event() if realtime else None
        self.checkpoint_dir = checkpoint_dir  # where a boundary save "lands" (HandledRequest.location)
        self.step = 0
        self.dead: int | None = None  # a rank whose worker died: the next poll says so
        self.hung: int | None = None  # a rank that stopped making progress
        self.hung_since = 0.0
        self.pending: tuple[int, int] | None = None  # (request id, kind) from request_boundary
        self.handled: HandledRequest | None = None
        self.finished = self.stopped = False
        self.calls = {"poll": 0, "heartbeats": 0, "request_boundary": 0, "stacks": 0, "shutdown": 0}
        self._reports: list[Report] = []
        self._last_reports: list[Report] = []
        self._beats: dict[int, Heartbeat | None] = {}
        self._lock = threading.Lock()  # advance() may run in another thread than poll()

    def start(self) -> dict[str, float]:
        return {}

    def launch(self, train_loop: Any, loop_config: Any) -> None:
        pass

    def advance(self, now: float) -> None:
        """One training step of every live rank (not timed: the workers' work, not the controller's)."""
        self.step += 1
        if self.pending is not None:  # the ranks agreed on the boundary at this step and saved there
            request_id, kind = self.pending
            self.handled = HandledRequest(request_id, kind, self.step, f"{self.checkpoint_dir}/global_step{self.step}")
            self.pending = None
            if kind == BoundaryRequest.STOP:
                self.finished = self.stopped = True
        reports = [report(rank, self.step) for rank in range(self.world_size) if rank != self.hung]
        beats = {rank: heartbeat(rank, self.step, 0.1, self.handled, self.finished) for rank in range(self.world_size)}
        if self.hung is not None:
            beats[self.hung] = heartbeat(self.hung, self.step - 1, now - self.hung_since, self.handled)
        with self._lock:
            self._reports, self._beats, self._last_reports = reports, beats, reports
        if self._stepped is not None:
            self._stepped.set()

    def repeat(self) -> None:
        """The last step's reports and heartbeats again, built once: the workers' side of a round costs
        the controller's process nothing (in a real run it happens in the workers' processes)."""
        with self._lock:
            self._reports = list(self._last_reports)
        if self._stepped is not None:
            self._stepped.set()

    def poll(self, timeout_s: float) -> GroupPoll:
        self.calls["poll"] += 1
        if self._stepped is not None:
            self._stepped.wait(timeout_s)
            self._stepped.clear()
        with self._lock:
            reports, self._reports = self._reports, []
        if self.dead is not None:
            return GroupPoll(reports, [Failure(FailureKind.WORKER_DIED, f"rank {self.dead}'s worker died", self.dead)])
        return GroupPoll(reports, finished=self.finished, stopped=self.stopped)

    def heartbeats(self, timeout_s: float) -> tuple[dict[int, Heartbeat | None], list[Failure]]:
        self.calls["heartbeats"] += 1
        return self._beats, []

    def request_boundary(self, request_id: int, kind: int) -> None:
        self.calls["request_boundary"] += 1
        self.pending = (request_id, int(kind))

    def stacks(self, timeout_s: float) -> dict[int, str]:
        self.calls["stacks"] += 1
        return {rank: STACK for rank in range(self.world_size)}

    def shutdown(self, until_free: bool = False) -> None:
        self.calls["shutdown"] += 1


# ---- the real RayWorkerGroup against hosted ranks ----------------------------------------------------

@ray.remote(num_cpus=0)
class RankHost:
    """Hosts many simulated ranks in one async actor: each rank's worker-side methods take the rank
    first (`collect` as `TrainWorker.collect`), and `relay_*` answer for a relay's ranks (a node, or
    small nodes together) as its `NodeRelay` would (`NodeRound`), without a Ray call per rank: that
    part of the work is the relay's."""

    def __init__(self, ranks: list[int], step_time_s: float, checkpoint_dir: str,
                 ranks_per_node: int = RANKS_PER_NODE) -> None:
        self.ranks = list(ranks)
        self.ranks_per_node = ranks_per_node
        self.step_time_s = step_time_s
        self.checkpoint_dir = checkpoint_dir
        self.step = 0
        self.queues: dict[int, list[Report]] = {rank: [] for rank in self.ranks}
        self.progress_at = dict.fromkeys(self.ranks, time.monotonic())
        self.pending: tuple[int, int] | None = None
        self.handled: HandledRequest | None = None
        self.finished = False
        self.stopped = False  # ended by a planned stop
        self._done: asyncio.Event | None = None
        self._ticker: asyncio.Task | None = None

    async def begin(self) -> int:
        import os

        self._done = asyncio.Event()
        self._ticker = asyncio.get_running_loop().create_task(self._tick())
        return os.getpid()

    async def _tick(self) -> None:
        while not self.finished:
            await asyncio.sleep(self.step_time_s)
            self.step += 1
            if self.pending is not None:
                request_id, kind = self.pending
                self.handled = HandledRequest(request_id, kind, self.step,
                                              f"{self.checkpoint_dir}/global_step{self.step}")
                self.pending = None
                if kind == BoundaryRequest.STOP:
                    self.finished = self.stopped = True
            now = time.monotonic()
            for rank in self.ranks:
                self.queues[rank].append(report(rank, self.step))
                self.progress_at[rank] = now
            if self.finished:
                self._done.set()

    async def run(self, rank: int, train_loop: Any, loop_config: Any) -> WorkerOutcome:
        await self._done.wait()
        return WorkerOutcome(rank, stopped=self.stopped)

    async def collect(self, rank: int, grace_s: float = 0.0) -> tuple[Heartbeat, list[Report]]:
        out, self.queues[rank] = self.queues[rank], []
        return heartbeat(rank, self.step, time.monotonic() - self.progress_at[rank], self.handled, self.finished,
                         self.ranks_per_node), out

    async def request_boundary(self, rank: int, request_id: int, kind: int) -> None:
        if self.pending is None or request_id > self.pending[0]:
            self.pending = (request_id, int(kind))

    async def stacks(self, rank: int) -> str:
        return STACK

    async def relay_collect(self, node: str, ranks: list[int], wait_s: float, fresh: bool,
                            grace_s: float = 0.0) -> NodeRound:
        out = NodeRound(node)
        for rank in ranks:
            beat, reports = await self.collect(rank)
            out.heartbeats[rank] = beat
            out.reports.extend(reports)
        return out

    async def relay_request_boundary(self, request_id: int, kind: int) -> None:
        await self.request_boundary(self.ranks[0], request_id, kind)


CALLS: Counter[str] = Counter()
"""Ray calls made through RankHandle and HostedRelay, by method (bench/scale.py clears and reads it)."""


class _Method:
    def __init__(self, method: Any, name: str, *leading: Any) -> None:
        self._method, self._name, self._leading = method, name, leading

    def remote(self, *args: Any) -> Any:
        CALLS[self._name] += 1
        return self._method.remote(*self._leading, *args)


class CountedHandle:
    """An actor handle whose calls are counted in CALLS; with `leading` arguments, the same before every
    call's own. `RankHandle(host, rank)` looks like a TrainWorker actor handle to RayWorkerGroup and
    NodeRelay: `handle.collect.remote()` is one Ray call to the rank's host, for this rank."""

    def __init__(self, handle: Any, *leading: Any) -> None:
        self._handle, self._leading = handle, leading

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):  # pickle's probes (the real relay gets these handles)
            raise AttributeError(name)
        return _Method(getattr(self._handle, name), name, *self._leading)


RankHandle = CountedHandle


class HostedRelay:
    """Looks like a NodeRelay actor handle to RelayRounds: one Ray call to the host of the relay's ranks."""

    def __init__(self, host: Any, node: str, ranks: list[int]) -> None:
        self.collect = _Method(host.relay_collect, "collect", node, ranks)
        self.request_boundary = _Method(host.relay_request_boundary, "request_boundary")


class HostedRayWorkerGroup(RayWorkerGroup):
    """`RayWorkerGroup` whose ranks live in `hosts` RankHost actors, whole relay groups per host
    (`relay_groups` over nodes of `ranks_per_node` ranks, each node a host of its own; `per_relay`
    as `RANKS_PER_RELAY`, or 1: a relay per node, as before [Note: relays for small nodes]); the last
    rank alone in its own host, its relay group relayed by a real `NodeRelay`."""

    def __init__(self, world_size: int, hosts: int, step_time_s: float = 1.0, checkpoint_dir: str = "/nonexistent",
                 ranks_per_node: int = RANKS_PER_NODE, per_relay: int = RANKS_PER_RELAY):
        super().__init__(ScalingConfig(num_workers=world_size), world_size, {}, process_group_timeout_s=60.0)
        self.world_size, self.host_count = world_size, hosts
        self.step_time_s, self.checkpoint_dir = step_time_s, checkpoint_dir
        self.ranks_per_node, self.per_relay = ranks_per_node, per_relay
        self.hosts: list[Any] = []
        self.victim_rank = world_size - 1
        self.victim_pid = 0
        self.victim_relay: Any = None
        self.stacks_asked_at: float | None = None  # when the controller decided on a hang and asked for stacks

    def start(self) -> dict[str, float]:
        started = time.monotonic()
        nodes = [node_of(rank, self.ranks_per_node) for rank in range(self.world_size)]
        groups = relay_groups([(node, f"host-{node}") for node in nodes], self.per_relay)
        victim_group = next(index for index, group in enumerate(groups) if self.victim_rank in group.ranks)
        others = [[rank for rank in group.ranks if rank != self.victim_rank] for group in groups]
        chunks = [[rank for ranks in others[index::self.host_count] for rank in ranks]
                  for index in range(self.host_count)]
        chunks = [chunk for chunk in chunks if chunk]
        options = {"max_concurrency": 2 * self.world_size + 100}  # every rank's run + a collect in flight
        self.hosts = [RankHost.options(**options).remote(chunk, self.step_time_s, self.checkpoint_dir,
                                                         self.ranks_per_node) for chunk in chunks]
        victim = RankHost.options(max_concurrency=100).remote([self.victim_rank], self.step_time_s,
                                                              self.checkpoint_dir, self.ranks_per_node)
        self.hosts.append(victim)
        pids = ray.get([host.begin.remote() for host in self.hosts], timeout=120)
        self.victim_pid = pids[-1]
        host_of = {rank: host for chunk, host in zip(chunks, self.hosts) for rank in chunk}
        host_of[self.victim_rank] = victim
        self._workers = [RankHandle(host_of[rank], rank) for rank in range(self.world_size)]
        # the real node and each rank's host process: a hang report reads a silent rank's stacks from
        # outside with py-spy there
        here = ray.get_runtime_context().get_node_id()
        pid_of = {rank: pid for chunk, pid in zip(chunks, pids) for rank in chunk}
        pid_of[self.victim_rank] = self.victim_pid
        self._infos = [NodeInfo(here, "127.0.0.1", (), pid_of[rank]) for rank in range(self.world_size)]
        group = groups[victim_group]
        self.victim_relay = ray.remote(NodeRelay).options(num_cpus=0).remote(
            group.home, {rank: self._workers[rank] for rank in group.ranks})
        relays = [CountedHandle(self.victim_relay) if index == victim_group
                  else HostedRelay(host_of[group.ranks[0]], group.home, list(group.ranks))
                  for index, group in enumerate(groups)]

        def gather_here(index: int) -> NodeRelay:  # as RayWorkerGroup's: a dead relay's ranks asked from here
            return NodeRelay(groups[index].home, {rank: self._workers[rank] for rank in groups[index].ranks})

        self._rounds = RelayRounds(relays, [list(group.ranks) for group in groups], [group.home for group in groups],
                                   gather_here)
        ray.get(self.victim_relay.ready.remote(), timeout=120)
        return {"worker_start_s": time.monotonic() - started}

    def stacks(self, timeout_s: float) -> dict[int, str]:
        self.stacks_asked_at = time.monotonic()
        return super().stacks(timeout_s)

    def shutdown(self, until_free: bool = False) -> None:
        for handle in [*self.hosts, *([self.victim_relay] if self.victim_relay is not None else [])]:
            ray.kill(handle)
        self.hosts, self.victim_relay = [], None
        self._workers, self._run_refs, self._rounds = [], {}, None


# ---- the controller as bench/scale.py runs it ------------------------------------------------------

def cpu() -> float:
    """CPU seconds of this whole process (every thread: the controller's, gRPC's, Ray's core worker)."""
    return time.process_time()


def controller_over(group_factory: Any, world_size: int, clock: Any, checkpoint_dir: str | None,
                    hang_timeout_s: float = HANG_LIMIT_S, poll_timeout_s: float = 1.0) -> Controller:
    settings = ControllerSettings(hang=HangPolicy(hang_timeout_s=hang_timeout_s),
                                  checkpoint_locations=(checkpoint_dir,) if checkpoint_dir else ())
    return Controller(group_factory, lambda: None, None, FailurePolicy(-1), poll_timeout_s=poll_timeout_s,
                      plan=BatchPlan(max(1, world_size // 2), world_size, None), settings=settings, clock=clock)


def run_controller(controller: Controller, stop: threading.Event,
                   transitions: list[tuple[float, RunState]] | None = None) -> threading.Thread:
    """Step in a thread until the run ends or `stop` is set (as `ControllerActor._loop` does),
    recording (time, new state) after each step that changed the state."""
    def loop() -> None:
        while not controller.state.is_terminal and not stop.is_set():
            before = controller.state
            controller.step()
            if transitions is not None and controller.state is not before:
                transitions.append((time.monotonic(), controller.state))

    thread = threading.Thread(target=loop, name="controller", daemon=True)
    thread.start()
    return thread
