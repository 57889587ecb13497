"""The group of worker actors of one attempt: placement group, ranks, environment, streaming.

`RayWorkerGroup` is the only part of the controller that talks to Ray about workers; the state
machine in `controller.py` sees it through the `WorkerGroup` protocol, so tests can drive the state
machine with a fake group.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rayzero.config.run_settings import ScalingConfig
from rayzero.controller.errors import ResourcesUnavailableError
from rayzero.controller.failures import Failure, FailureKind
from rayzero.controller.relay_rounds import RelayRounds, relay_groups
from rayzero.workers.actor import NodeInfo, TrainWorker, WorkerOutcome
from rayzero.workers.boundary import Heartbeat
from rayzero.workers.errors import WorkerSetupError
from rayzero.workers.relay import NodeRelay, ray_values
from rayzero.workers.session import Report

logger = logging.getLogger("rayzero.controller")

# How long the last collect of finished ranks, or of the survivors of a failure, may take: an answer
# takes milliseconds; the margin is for a loaded machine (a report not collected then is lost).
_LAST_COLLECT_S = 15.0
# After a failure, how long a survivor that has nothing queued is given to report: a loop often
# reports right after the step in which another rank failed (the metrics the user wants to see).
_SURVIVOR_GRACE_S = 1.0
# Silent ranks whose stacks a hang report reads from outside (one py-spy task each).
_MAX_OUTSIDE_READS = 16


@dataclass
class GroupPoll:
    """What one poll of the group found."""

    reports: list[Report] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    finished: bool = False
    """True once every rank's loop has returned normally."""
    stopped: bool = False
    """With `finished`: the loops ended because the run was told to stop (a planned stop)."""
    preempted: list[int] = field(default_factory=list)
    """With `stopped`: ranks whose process got SIGTERM (a preemption, not a request)."""
    save_stall_s: float = 0.0
    """With `finished`: the most seconds a rank's loop waited on saves in this attempt."""
    committed: tuple[int, str] | None = None
    """With `finished`: the newest checkpoint a finished rank found committed in its checkpoint
    directory as its loop ended (node-local runs: the boundary save of a planned stop)."""


class WorkerGroup(Protocol):
    def start(self) -> dict[str, float]: ...  # returns phase timings (seconds)

    def launch(self, train_loop: Callable[..., Any], loop_config: dict[str, Any] | None) -> None: ...

    def poll(self, timeout_s: float) -> GroupPoll: ...

    def heartbeats(self, timeout_s: float) -> tuple[dict[int, Heartbeat | None], list[Failure]]:
        """Each rank's heartbeat (None: no answer in time), and ranks found dead."""
        ...

    def request_boundary(self, request_id: int, kind: int) -> None:
        """Ask every rank for a checkpoint (kind CHECKPOINT) or a stop (STOP) at the agreed boundary."""
        ...

    def stacks(self, timeout_s: float) -> dict[int, str]:
        """Every rank's Python thread stacks (for hang reports); ranks that do not answer are left out."""
        ...

    def shutdown(self, until_free: bool = False) -> None:
        """Kill the workers; `until_free`: return once Ray shows their resources free ([Note: resources back])."""
        ...


@ray.remote
def _py_spy_dump(pid: int) -> str:
    """A process's Python stacks read from outside it (works on a stopped process: --nonblocking
    reads its memory without attaching). py-spy comes with ray[default]."""
    import shutil
    import subprocess
    import sys

    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    done = subprocess.run([py_spy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True,
                          timeout=20, check=False)
    return done.stdout if done.returncode == 0 else f"(py-spy failed: {done.stderr.strip() or done.returncode})"


def draining_nodes() -> set[str]:
    """Ids of the nodes Ray is draining (the autoscaler's or a cloud's preemption notice)."""
    from ray._private.state import state

    return set(state.get_draining_nodes())


def free_worker_slots(bundle: dict[str, float]) -> int:
    """How many more worker bundles fit in the free resources now, counted node by node (a bundle
    does not span nodes) and leaving out nodes Ray is draining. A bound, not a promise."""
    from ray._private.state import available_resources_per_node

    draining = draining_nodes()
    slots = 0
    for node_id, free in available_resources_per_node().items():
        if node_id in draining:
            continue
        fits = [int(free.get(key, 0.0) // amount) for key, amount in bundle.items() if amount > 0]
        slots += min(fits) if fits else 0
    return slots


_RETURN_WAIT_S = 5.0
"""The most a group's shutdown waits for Ray to show its resources free again ([Note: resources back])."""


def _free_per_node(nodes: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The free resources of `nodes` now, as Ray's resource view shows them."""
    if not nodes:
        return {}
    from ray._private.state import available_resources_per_node

    free = available_resources_per_node()
    return {node: dict(free[node]) for node in nodes if node in free}


def _until_returned(held: dict[str, dict[str, float]], before: dict[str, dict[str, float]], limit_s: float) -> None:
    """Wait up to `limit_s` until each node shows the resources `held` there free again.

    [Note: resources back]
    Killing the workers and removing their placement group returns their CPUs and GPUs to Ray
    asynchronously: the raylet frees them once it sees the processes exit, and Ray's resource view
    (what `free_worker_slots` reads) shows it a moment later, up to a second or two on a loaded node.
    What comes at once reads that view: a preemption's regroup and a resize size their group to the
    free slots (they started smaller than they could, and grew back through another restart later),
    and a script's next `rayzero.fit` (a sweep) found its CPUs still taken. So those shutdowns (the
    controller's `until_free`) wait until the view shows what the group held free again, relative
    to what was free before (other work may take the resources meanwhile: the wait is bounded, and
    then simply ends). A failure's shutdown does not wait: its node may be gone (the view keeps a
    lost node until Ray's health checks give it up, so the wait would only run out), and the retry
    backoff comes before the restart reads the view."""
    if not held:
        return
    deadline = time.monotonic() + limit_s
    pause = 0.05  # then doubling up to 0.5 s: about a dozen reads of the GCS's view over the whole wait
    while True:
        now = _free_per_node(held)  # a node that left the cluster has nothing to give back
        if all(now[node].get(key, 0.0) >= before.get(node, {}).get(key, 0.0) + amount - 1e-6
               for node, amounts in held.items() if node in now for key, amount in amounts.items()):
            return
        if time.monotonic() >= deadline:
            logger.debug("resources of the group not shown free after %.0f s: %s (before %s)", limit_s, now, before)
            return
        time.sleep(pause)
        pause = min(2 * pause, 0.5)


def assign_ranks(infos: list[NodeInfo]) -> list[tuple[int, int, int]]:
    """(global rank, local rank, local world size) per actor index.

    Ranks are contiguous per node, nodes in the order their first worker appears, and within a node
    ordered by GPU id, so `cuda:LOCAL_RANK` indexes the node's GPUs as torchrun would.
    """
    node_order: list[str] = []
    for info in infos:
        if info.node_id not in node_order:
            node_order.append(info.node_id)
    order = sorted(
        range(len(infos)),
        key=lambda i: (node_order.index(infos[i].node_id), [_gpu_key(g) for g in infos[i].gpu_ids], i),
    )
    per_node = {node: sum(1 for info in infos if info.node_id == node) for node in node_order}
    seen: dict[str, int] = {}
    out: list[tuple[int, int, int]] = [(0, 0, 0)] * len(infos)
    for rank, index in enumerate(order):
        node = infos[index].node_id
        out[index] = (rank, seen.get(node, 0), per_node[node])
        seen[node] = seen.get(node, 0) + 1
    return out


def _gpu_key(gpu_id: str) -> tuple[int, str]:
    return (int(gpu_id), gpu_id) if gpu_id.isdigit() else (1 << 30, gpu_id)


class RayWorkerGroup:
    """One placement group with one worker actor per bundle, forming one torch process group."""

    def __init__(
        self,
        scaling: ScalingConfig,
        num_workers: int,
        run_env: dict[str, str],
        process_group_timeout_s: float,
        datasets: dict[str, Any] | None = None,
        node_local_root: str = "/tmp/rayzero-node-local",  # not /tmp/rayzero: a bare `rayzero` dir in the cwd would shadow the package
    ) -> None:
        self._scaling = scaling
        self._num_workers = num_workers  # this attempt's size, within the elastic range
        self._run_env = dict(run_env)  # RAYZERO_* variables shared by every rank
        self._timeout_s = process_group_timeout_s
        self._datasets = dict(datasets or {})
        self._node_local_root = node_local_root  # default; a node exporting its own wins (TrainWorker)
        self._pg = None
        self._workers: list[Any] = []  # actor handles, index = rank once started
        self._infos: list[NodeInfo | None] = []  # where each rank runs (node, pid), index = rank
        # Heartbeats and reports come through one relay per node ([Note: node relays]); run() calls are
        # kept by rank, so each rank's bookkeeping is O(1) ([Note: per-rank calls]).
        self._rounds: RelayRounds | None = None
        self._relay_actors: list[Any] = []  # the relay actors started (killed at shutdown, even if replaced)
        self._unheard: set[int] = set()  # ranks without a heartbeat in the last round (stacks() waits not on them)
        self._run_refs: dict[int, Any] = {}  # rank -> outstanding run() call
        self._done: set[int] = set()
        self._stopped: set[int] = set()  # ranks whose loop ended through a planned stop
        self._preempted: set[int] = set()  # ranks whose process got SIGTERM
        self._save_stall_s = 0.0  # the most a finished rank's loop waited on saves (goodput)
        self._committed: tuple[int, str] | None = None  # the newest checkpoint a finished rank found on its disk
        self.placement_timeout_s = scaling.placement_timeout_s  # the controller shortens it for tries above min

    def start(self) -> dict[str, float]:
        timings: dict[str, float] = {}
        started = time.monotonic()
        bundle = self._scaling.bundle()
        bundles = [dict(bundle) for _ in range(self._num_workers)]
        self._pg = placement_group(bundles, strategy=self._scaling.placement_strategy, name="")
        ready, _ = ray.wait([self._pg.ready()], timeout=self.placement_timeout_s)
        if not ready:
            self.shutdown()
            raise ResourcesUnavailableError(_unschedulable_message(self._scaling, bundle, self._num_workers,
                                                                   self.placement_timeout_s))
        timings["placement_group_s"] = time.monotonic() - started

        started = time.monotonic()
        actor_class = ray.remote(TrainWorker)
        gpus = bundle.get("GPU", 0.0)
        extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
        actors = [
            actor_class.options(
                num_cpus=bundle.get("CPU", 0.0),
                num_gpus=gpus,
                resources=extra or None,
                max_concurrency=4,  # run(), collect(), a request and stacks at the same time
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
            ).remote()
            for i in range(self._num_workers)
        ]
        infos: list[NodeInfo] = ray.get([actor.node_info.remote() for actor in actors], timeout=self._timeout_s)
        ranks = assign_ranks(infos)
        self._workers = [None] * len(actors)
        self._infos = [None] * len(actors)
        for index, (rank, _, _) in enumerate(ranks):
            self._workers[rank] = actors[index]
            self._infos[rank] = infos[index]
        timings["worker_start_s"] = time.monotonic() - started

        started = time.monotonic()
        rank0_index = next(i for i, (rank, _, _) in enumerate(ranks) if rank == 0)
        master_addr = infos[rank0_index].node_ip
        master_port = ray.get(actors[rank0_index].master_port.remote(), timeout=60)
        shards = self._split_datasets()
        backend = "nccl" if self._scaling.use_gpu else "gloo"
        setups = []
        # torchrun's GROUP_RANK: the node's index, nodes in rank order (ranks are contiguous per node)
        nodes = list(dict.fromkeys(infos[index].node_id for index in sorted(range(len(ranks)),
                                                                            key=lambda i: ranks[i][0])))
        for index, (rank, local_rank, local_world) in enumerate(ranks):
            env = dict(self._run_env)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(local_rank),
                WORLD_SIZE=str(len(actors)),
                LOCAL_WORLD_SIZE=str(local_world),
                GROUP_RANK=str(nodes.index(infos[index].node_id)),
                NODE_RANK=str(nodes.index(infos[index].node_id)),
                GROUP_WORLD_SIZE=str(len(nodes)),
                MASTER_ADDR=master_addr,
                MASTER_PORT=str(master_port),
                RAYZERO_NODE_ID=infos[index].node_id,
                RAYZERO_NODE_LOCAL_DIR=f"{self._node_local_root}/{infos[index].node_id}",
            )
            if self._scaling.use_gpu:
                node_gpus = sorted(
                    {g for info in infos if info.node_id == infos[index].node_id for g in info.gpu_ids},
                    key=_gpu_key,
                )
                env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
            rank_shards = {name: split[rank] for name, split in shards.items()}
            setups.append(actors[index].setup.remote(rank, env, backend, self._timeout_s, rank_shards))
        self._rounds = self._start_relays()
        ray.get(setups + [relay.ready.remote() for relay in self._relay_actors], timeout=self._timeout_s + 60)
        timings["process_group_s"] = time.monotonic() - started
        return timings

    def _start_relays(self) -> RelayRounds:
        """A `NodeRelay` per group of ranks ([Note: relays for small nodes]: a node of several ranks,
        or small nodes packed together), on the group's node ([Note: node relays]); a group of one
        relay gets it in this process ([Note: one node, no relay actor])."""
        where = []
        for info in self._infos:
            assert info is not None
            where.append((info.node_id, info.node_ip))
        groups = relay_groups(where)

        def gather_here(index: int) -> NodeRelay:  # the relay died: its ranks are asked from here
            group = groups[index]
            return NodeRelay(group.home, {rank: self._workers[rank] for rank in group.ranks})

        if len(groups) == 1:
            self._relay_actors = []
            return RelayRounds([gather_here(0)], [list(groups[0].ranks)], [groups[0].home])
        relay_class = ray.remote(NodeRelay)
        self._relay_actors = [
            relay_class.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(group.home, soft=False))
            .remote(group.home, {rank: self._workers[rank] for rank in group.ranks})
            for group in groups
        ]
        return RelayRounds(list(self._relay_actors), [list(group.ranks) for group in groups],
                           [group.home for group in groups], gather_here)

    def _split_datasets(self) -> dict[str, list[Any]]:
        # equal=True gives every rank the same number of rows, so no rank runs out of batches first
        # and blocks the others in a collective.
        return {
            name: dataset.streaming_split(len(self._workers), equal=True)
            for name, dataset in self._datasets.items()
        }

    def launch(self, train_loop: Callable[..., Any], loop_config: dict[str, Any] | None) -> None:
        loop_ref = ray.put(train_loop)  # one copy in the object store, not one per rank
        for rank, worker in enumerate(self._workers):
            self._run_refs[rank] = worker.run.remote(loop_ref, loop_config)

    def poll(self, timeout_s: float) -> GroupPoll:
        # [Note: per-rank calls]
        # The group holds one run() call per rank (a death or a loop's end is seen at once) and makes
        # one collect call per node per heartbeat round ([Note: node relays]); a poll costs O(ranks)
        # (ray.wait over the run() calls) and must cost no more: what each finished call needs is
        # looked up by rank, never by scanning the outstanding calls (which made a poll in which every
        # rank answered O(ranks^2): about a second at 4,096 ranks), and ranks that finish together
        # are collected in one batched round of their relays. bench/scale.py measures the pattern.
        assert self._rounds is not None, "start() must run before poll()"
        result = GroupPoll()
        pending = list(self._run_refs.values())
        if pending:
            ready, _ = ray.wait(pending, num_returns=1, timeout=0.0 if self._rounds.has_news else timeout_s)
            if ready:  # take everything else that is ready too, in one pass
                ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
            ready_set = set(ready)
            finished = [(rank, ref) for rank, ref in self._run_refs.items() if ref in ready_set]
            for rank, _ in finished:
                del self._run_refs[rank]
            self._finish_ranks(finished, result)
        result.reports = self._rounds.take_reports()  # reports before outcomes, each rank's in order
        result.failures = self._rounds.take_failures() + result.failures
        if result.failures:
            self._drain_survivors(result)
        result.finished = not result.failures and len(self._done) == len(self._workers)
        result.stopped = result.finished and bool(self._stopped)
        result.preempted = sorted(self._preempted) if result.stopped else []
        result.save_stall_s = self._save_stall_s if result.finished else 0.0
        result.committed = self._committed if result.finished else None
        return result

    def heartbeats(self, timeout_s: float) -> tuple[dict[int, Heartbeat | None], list[Failure]]:
        """One round: a collect per node ([Note: node relays]); its reports wait for the next poll."""
        assert self._rounds is not None, "start() must run before heartbeats()"
        self._rounds.round(timeout_s)
        beats: dict[int, Heartbeat | None] = dict.fromkeys(range(len(self._workers)))
        beats.update(self._rounds.take_heartbeats())
        self._unheard = {rank for rank, beat in beats.items() if beat is None}
        # A death this round found stays with the rounds: the next poll (which then does not wait)
        # hands it out after the reports made before it and takes the survivors' last reports first.
        # Handed out here, the group was torn down with those reports still queued (a rank's metrics
        # of a whole attempt lost when its node-mate died between two polls).
        return beats, []

    def request_boundary(self, request_id: int, kind: int) -> None:
        if self._rounds is not None:
            self._rounds.request_boundary(request_id, int(kind))

    def stacks(self, timeout_s: float) -> dict[int, str]:
        """Every rank's Python stacks: asked of the worker itself, and for a rank that does not answer
        (stopped, wedged outside Python) read from outside its process with py-spy, on its node."""
        refs = {worker.stacks.remote(): rank for rank, worker in enumerate(self._workers) if worker is not None}
        # wait for the ranks heard in the last round; one silent since is read from outside at once
        expected = [ref for ref, rank in refs.items() if rank not in self._unheard]
        if expected:
            ray.wait(expected, num_returns=len(expected), timeout=min(timeout_s, 2.0))
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        out = {}
        for ref in ready:
            try:
                out[refs[ref]] = ray.get(ref)
            except ray.exceptions.RayError as error:
                out[refs[ref]] = f"(no stacks: {error})"
        silent = [rank for rank in refs.values() if rank not in out]
        for rank in silent[_MAX_OUTSIDE_READS:]:  # a whole rack silent must not start a py-spy task per rank
            out[rank] = (f"(the process did not answer; not read from outside: py-spy reads only the first "
                         f"{_MAX_OUTSIDE_READS} of the {len(silent)} silent ranks)")
        outside = {}
        for rank in silent[:_MAX_OUTSIDE_READS]:
            info = self._infos[rank] if rank < len(self._infos) else None
            if info is not None:
                outside[_py_spy_dump.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                    info.node_id, soft=False)).remote(info.pid)] = rank
        ready, _ = ray.wait(list(outside), num_returns=len(outside), timeout=timeout_s) if outside else ([], [])
        for ref, rank in outside.items():
            try:
                out[rank] = ("(the process did not answer; read from outside with py-spy)\n" + ray.get(ref)
                             if ref in ready else "(the process did not answer, and py-spy found nothing in time)")
            except ray.exceptions.RayError as error:
                out[rank] = f"(the process did not answer; py-spy could not run on its node: {error})"
        return out

    def _drain_survivors(self, result: GroupPoll) -> None:
        """A failure tears the group down next: first take what the other ranks reported until now,
        so metrics made before the failure still reach the driver, in order. Bounded: a live rank
        answers within milliseconds; a dead one fails its call at once."""
        assert self._rounds is not None
        relays = range(len(self._rounds.relays))
        self._rounds.settle(relays, _LAST_COLLECT_S)
        self._rounds.round(_LAST_COLLECT_S, relays, last=True, grace_s=_SURVIVOR_GRACE_S)
        result.reports.extend(self._rounds.take_reports())
        self._rounds.take_failures()  # a second casualty: the first failure is the one to blame

    def _finish_ranks(self, finished: list[tuple[int, Any]], result: GroupPoll) -> None:
        """Ranks whose run() returned, with that call: their outcomes and their last reports."""
        assert self._rounds is not None
        outcomes: list[tuple[int, WorkerOutcome]] = []
        for rank, value in zip([rank for rank, _ in finished], ray_values([ref for _, ref in finished])):
            if isinstance(value, ray.exceptions.RayActorError):
                result.failures.append(_died(rank, value))
            else:
                outcomes.append((rank, value))
        # What the loops reported since their relays' last answer: the outstanding collects first, then
        # one fresh collect of each relay (two at once to one relay would break its ranks' order).
        relays = {self._rounds.relay_of[rank] for rank, _ in outcomes}
        self._rounds.settle(relays, _LAST_COLLECT_S)
        self._rounds.round(_LAST_COLLECT_S, relays, last=True)
        for rank, outcome in outcomes:
            if outcome.error is None:
                self._done.add(rank)
                if outcome.stopped:
                    self._stopped.add(rank)
                if outcome.preempted:
                    self._preempted.add(rank)
                self._save_stall_s = max(self._save_stall_s, outcome.save_stall_s)
                if outcome.committed is not None and (self._committed is None or outcome.committed > self._committed):
                    self._committed = outcome.committed
            else:
                result.failures.append(
                    Failure(
                        FailureKind.LOOP_ERROR,
                        f"rank {rank} raised {outcome.error}",
                        rank,
                        outcome.traceback_text,
                        outcome.exit_code,
                    )
                )

    def shutdown(self, until_free: bool = False) -> None:
        # Leave the process group cleanly only when every loop ended: after a failure the other
        # ranks may sit in a collective, and both actor slots are busy (run + poll), so the call
        # would only wait out its timeout before the kill below.
        if self._workers and len(self._done) == len(self._workers):
            try:
                ray.get([w.shutdown.remote() for w in self._workers], timeout=10)
            except Exception as error:  # noqa: BLE001 - the actors are killed next either way
                logger.debug("worker shutdown before kill failed: %s", error)
        held = self._held_per_node() if self._pg is not None and until_free else {}
        free_before = _free_per_node(held)
        for handle in [*self._workers, *self._relay_actors]:
            if handle is not None:
                ray.kill(handle)
        self._workers, self._run_refs, self._rounds, self._relay_actors = [], {}, None, []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
            _until_returned(held, free_before, _RETURN_WAIT_S)

    def _held_per_node(self) -> dict[str, dict[str, float]]:
        """node -> resources the group's placement group holds there (its workers' bundles)."""
        bundle = {key: amount for key, amount in self._scaling.bundle().items() if amount > 0}
        held: dict[str, dict[str, float]] = {}
        for info in self._infos:
            if info is not None:
                on_node = held.setdefault(info.node_id, {})
                for key, amount in bundle.items():
                    on_node[key] = on_node.get(key, 0.0) + amount
        return held


def setup_failure(error: BaseException) -> Failure:
    """A `Failure` for an exception raised while starting the group."""
    if isinstance(error, ResourcesUnavailableError):
        return Failure(FailureKind.SCHEDULING, str(error))
    if isinstance(error, WorkerSetupError):
        return Failure(FailureKind.SETUP_ERROR, error.message, error.rank, error.traceback_text)
    if isinstance(error, ray.exceptions.RayActorError):
        return Failure(FailureKind.WORKER_DIED, f"a worker died while starting: {error}")
    return Failure(FailureKind.SETUP_ERROR, f"{type(error).__name__}: {error}")


def _died(rank: int, error: BaseException) -> Failure:
    return Failure(FailureKind.WORKER_DIED, f"rank {rank}'s worker died: {error}", rank)


def _unschedulable_message(scaling: ScalingConfig, bundle: dict[str, float], workers: int, waited_s: float) -> str:
    try:
        total = {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")}
        free = {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}
    except Exception:  # noqa: BLE001 - the message matters more than the numbers
        total, free = {}, {}
    needed = {key: value * workers for key, value in bundle.items()}
    return (
        f"could not place {workers} worker(s) of {bundle} each (in all {needed}, strategy "
        f"{scaling.placement_strategy}) within {waited_s:g}s (placement_timeout_s={scaling.placement_timeout_s:g}). "
        f"The cluster has {total} in total, {free} free now. Fix: lower ScalingConfig.num_workers or "
        "resources_per_worker (--workers / --gpus-per-worker), add nodes, or raise placement_timeout_s "
        "if an autoscaler is adding them."
    )
