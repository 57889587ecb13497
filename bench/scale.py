"""The control path at 64 ... 4,096 workers, by simulation on one machine (issue 24, section 4). Prints JSON.

    python bench/scale.py [--sizes 64,256,1024,4096] [--sections checkpoint,logic,grpc,metrics,ray,small_nodes]
                          [--json bench/results/scale.json] [--plot bench/results/scale.png]
    python bench/scale.py --quick                       # sizes 16,64, short windows (the smoke test)
    python bench/scale.py --doc docs/scale.md [--check] # the goodput model's tables from bench/results

What runs is rayzero's own code; only the workers are simulated (bench/scale_sim.py):

- `checkpoint`: the real `CheckpointSaver.save` as rank 0 of an N-rank world (node-local tiers, one
  replica per shard, 8 ranks per node): the other N-1 ranks' shard files are written first by the real
  shard writer, and their gathers (shard specs, written files, RNG states) are handed to the saver by
  a stand-in for the checkpoint process group (an N-rank gloo group does not fit on 2 cores). The
  leader's part - the manifest of N shards, the replica plan, the commit and `latest` - is timed; then
  the controller's registry lists the directory (`committed_checkpoints.committed_in`, `CheckpointTracker`).
  Beside them, the bytes a load's inventory exchange sends each rank (node-local and shared storage),
  from bench/scale_loader.py's model of the loader's payloads.
- `logic` (a): the real `Controller`, stepped as `ControllerActor` does, over `SimulatedGroup` (N ranks in
  this process, each round's reports and heartbeats built before the step is timed) on a simulated
  clock: CPU per heartbeat round, per poll of N reports, per driver poll (`take_update` + pickling it,
  what Ray does to the reply), per status snapshot; a dead rank, a hung rank (the default limit, 55 s), the
  restart that follows, and a resize through the planned-stop handshake.
- `grpc`: the real `ControlServer` (rayzero.v1.Control) over that controller while it steps in real time
  (1 round/s, N reports/s): `GetStatus` latency from a client in a loop, and the intervals of a
  `WatchStatus` stream, all with N ranks in the status.
- `metrics`: the driver's `MetricsLog`: CPU per `add` and the cost of writing the part of N ranks' rows.
- `ray` (b): the real `RayWorkerGroup` code (a run() call per rank, one collect call per node per
  heartbeat round through the node relays, [Note: node relays]) against a few async Ray actors hosting
  the ranks, whole nodes of 8 each, the controller stepping in a thread at the real rate (a round a
  second, every rank reporting once a second): CPU of the controller process per wall second, and
  wall-clock detection of a SIGKILLed rank and a SIGSTOPped (hung) rank behind a real `NodeRelay`,
  each followed by the planned restart.
- `small_nodes`: the `ray` window at one rank per node, each node a host of its own: a relay per node
  (as before [Note: relays for small nodes]) and then relays of `RANKS_PER_RELAY` nodes, in the same run.

Each metric's growth exponent is the least-squares slope of log(value) against log(N).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import pickle
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import scale_loader, scale_sim
from bench.scale_sim import SimulatedGroup
from rayzero.config.run_settings import FailureConfig
from rayzero.controller.controller import Controller, ControllerSettings
from rayzero.controller.elastic import BatchPlan
from rayzero.controller.failures import FailurePolicy
from rayzero.controller.health import HangPolicy
from rayzero.controller.requests import ControlRequest, RequestKind
from rayzero.controller.states import RunState

SIZES = (64, 256, 1024, 4096)
QUICK_SIZES = (16, 64)
SECTIONS = ("checkpoint", "logic", "grpc", "metrics", "ray", "small_nodes")
TARGETS_AT = 4096
HANG_LIMIT_S = FailureConfig().hang_timeout_s  # the default a user gets (55 s)
EXPONENT_TOLERANCE = 0.1  # a fitted exponent up to 1.1 counts as linear: see pickle_reference_cpu_s


def cpu() -> float:
    """CPU seconds of this whole process (every thread: the controller's, gRPC's, Ray's core worker)."""
    return time.process_time()


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


# ---- checkpoint: the manifest of N shards, the commit, the registry scan ----------------------------

TENSORS = ("master", "optim/exp_avg", "optim/exp_avg_sq", "module")
LAYERS = 8
PIECE = 256  # fp32 elements of each tensor per rank: 32 tensors x 1 KiB per rank file


class SimulatedWorldComm:
    """Rank 0 of an N-rank world for `CheckpointSaver`: each gather returns rank 0's value beside what
    the other ranks prepared; barriers pass (only rank 0 runs). `group` is None, so the replica plan is
    made but no bytes are sent."""

    def __init__(self, world_size: int, others: list[list[Any]]) -> None:
        self.rank, self.world_size, self.distributed, self.group = 0, world_size, True, None
        self.node_ids = [scale_sim.node_of(rank) for rank in range(world_size)]
        self._others = iter(others)  # per gather: the values of ranks 1..N-1

    def all_gather_object(self, value: Any) -> list[Any]:
        others = next(self._others, None)  # past the prepared gathers (the commit's): all agree with rank 0
        return [value] * self.world_size if others is None else [value, *others]

    def broadcast_object(self, value: Any, src: int = 0) -> Any:
        return value

    def barrier(self) -> None:
        pass


def _rank_state(world_size: int, rank: int) -> list[Any]:
    import torch

    from rayzero.checkpoint.types import ShardedTensor, ShardSpec

    return [ShardedTensor(ShardSpec(f"{kind}/layer{layer}.weight", (world_size * PIECE,), torch.float32,
                                    rank * PIECE, (rank + 1) * PIECE), torch.full((PIECE,), float(rank)))
            for kind in TENSORS for layer in range(LAYERS)]


def checkpoint_section(world_size: int, root: str) -> dict[str, Any]:
    from rayzero.checkpoint import rng
    from rayzero.checkpoint.manifest import MANIFEST, shard_file_name
    from rayzero.checkpoint.options import CheckpointOptions
    from rayzero.checkpoint.retention import claim_tag_dir, new_lineage
    from rayzero.checkpoint.saver import CheckpointSaver
    from rayzero.checkpoint.shard_file import write_shard_file
    from rayzero.controller import committed_checkpoints
    from rayzero.controller.committed_checkpoints import CheckpointTracker

    options = CheckpointOptions(node_local=True, replicas=1, keep_last=3, async_save=False)
    rng_state = rng.capture()
    out: dict[str, Any] = {}
    for step in (100, 200):  # two committed checkpoints for the registry to list
        tag = f"global_step{step}"
        # the leader claims the directory before any rank writes into it (as CheckpointSaver does)
        claim_tag_dir(os.path.join(root, tag), new_lineage())
        states = [_rank_state(world_size, rank) for rank in range(world_size)]
        started = time.perf_counter()
        written = [write_shard_file(os.path.join(root, tag, shard_file_name(rank)),
                                    [(shard.spec.name, shard.local) for shard in states[rank]], fsync=False)
                   for rank in range(1, world_size)]
        out["shard_write_s_per_file"] = (time.perf_counter() - started) / max(1, world_size - 1)
        # what the saver exchanges: each rank's payload beside its storage problems (none here)
        gathers = [[([shard.spec for shard in state], []) for state in states[1:]],
                   [((file, rng_state), []) for file in written]]
        saver = CheckpointSaver(options, SimulatedWorldComm(world_size, gathers))
        started, started_cpu = time.perf_counter(), cpu()
        saver.save(root, tag, step, 3, "digest", states[0], {"global_steps": step}, {}, asynchronous=False)
        wall, used = time.perf_counter() - started, cpu() - started_cpu
        timings = saver.wait()
        # rank 0's own shard write is not the commit's; of the two commits the least (as for CPU
        # elsewhere: the work's own cost, least disturbed by the other jobs on this shared machine)
        out.setdefault("commits_s", []).append(wall - timings.write)
        out["commit_s"] = min(out["commits_s"])
        out["save_cpu_s"] = min(used, out.get("save_cpu_s", used))  # all of rank 0's save (its 32 kB shard too)
        out["manifest_bytes"] = os.path.getsize(os.path.join(root, tag, MANIFEST))
    scans = []
    for _ in range(3):  # cold listings (a fresh cache each): wall of the first, least CPU of the three
        started, started_cpu = time.perf_counter(), cpu()
        found = committed_checkpoints.committed_in(root)
        scans.append((time.perf_counter() - started, cpu() - started_cpu))
        assert [item.record.step for item in found] == [200, 100], found
    out["registry_scan_s"] = scans[0][0]
    out["registry_scan_cpu_s"] = min(used for _, used in scans)
    tracker = CheckpointTracker((root,), node_local=False)
    started = time.perf_counter()
    tracker.refresh()  # the first listing parses each manifest once
    out["tracker_first_scan_s"] = time.perf_counter() - started
    started = time.perf_counter()
    tracker.refresh()  # what a failure costs later: the newest, then where to resume
    tracker.resume_location()
    out["tracker_failure_scans_s"] = time.perf_counter() - started
    # what a load's inventory exchange sends each rank ([Note: one inventory per location]): a model of
    # the loader's payloads (bench/scale_loader.py), for this layout and for shared storage
    out.update(scale_loader.inventory_bytes(world_size, scale_sim.RANKS_PER_NODE, options.node_local, options.replicas))
    shared = scale_loader.inventory_bytes(world_size, scale_sim.RANKS_PER_NODE, node_local=False, replicas=0)
    out.update({f"shared_{key}": value for key, value in shared.items()})
    return out


# ---- logic (a): the controller over a simulated group, on a simulated clock ------------------------

class SimClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _controller(group_factory: Any, world_size: int, clock: Any, checkpoint_dir: str | None,
                hang_timeout_s: float = HANG_LIMIT_S, poll_timeout_s: float = 1.0) -> Controller:
    settings = ControllerSettings(hang=HangPolicy(hang_timeout_s=hang_timeout_s),
                                  checkpoint_locations=(checkpoint_dir,) if checkpoint_dir else ())
    return Controller(group_factory, lambda: None, None, FailurePolicy(-1), poll_timeout_s=poll_timeout_s,
                      plan=BatchPlan(max(1, world_size // 2), world_size, None), settings=settings, clock=clock)


def _timed_step(controller: Controller) -> float:
    started = cpu()
    controller.step()
    return cpu() - started


def logic_section(world_size: int, checkpoint_dir: str | None, rounds: int) -> dict[str, Any]:
    from rayzero.controller.control_server import ControlServicer

    clock = SimClock()
    groups: list[SimulatedGroup] = []

    def factory(attempt: int, resume: str | None, workers: int) -> SimulatedGroup:
        groups.append(SimulatedGroup(workers, checkpoint_dir or "/nonexistent"))
        return groups[-1]

    controller = _controller(factory, world_size, clock, checkpoint_dir)
    while controller.state is not RunState.RUNNING:
        controller.step()
    group = groups[-1]
    clock.now += 1.0
    group.advance(clock.now)
    controller.step()  # the first round: heartbeats due at once; from here on they alternate with polls
    heartbeat_cpu, report_cpu, update_cpu, update_bytes, status_cpu, status_bytes = [], [], [], [], [], []
    status_again_cpu: list[float] = []
    target = _StatusTarget(controller)
    servicer = ControlServicer(target)  # what the gRPC service does per call, without the transport
    for _ in range(rounds):
        clock.now += 0.5  # half a second: a poll that brings every rank's report, no heartbeat due
        group.advance(clock.now)
        report_cpu.append(_timed_step(controller))
        clock.now += 0.5  # the heartbeat round (no new reports)
        heartbeat_cpu.append(_timed_step(controller))
        started = cpu()
        update = controller.take_update()  # the driver's poll, and Ray pickling the reply
        update_bytes.append(len(pickle.dumps(update, protocol=5)))
        update_cpu.append(cpu() - started)
        started = cpu()  # the rank table of a new round: built, converted
        status_bytes.append(len(servicer._message(target.status()).SerializeToString()))
        status_cpu.append(cpu() - started)
        started = cpu()  # another call in the same round: the table as it was
        servicer._message(target.status()).SerializeToString()
        status_again_cpu.append(cpu() - started)
    assert update_bytes and controller.world_size == world_size
    reports = [scale_sim.report(rank, 1) for rank in range(world_size)]
    reference = []
    for _ in range(rounds):  # the machine's own growth for work linear by construction
        started = cpu()
        pickle.dumps(reports, protocol=5)
        reference.append(cpu() - started)
    # the least of the rounds: the work's own cost, least disturbed by other load on the machine
    out: dict[str, Any] = {
        "heartbeat_round_cpu_s": min(heartbeat_cpu),
        "reports_poll_cpu_s": min(report_cpu),
        "driver_update_cpu_s": min(update_cpu),
        "driver_update_bytes": statistics.median(update_bytes),
        "status_cpu_s": min(status_cpu),
        "status_again_cpu_s": min(status_again_cpu),
        "status_bytes": statistics.median(status_bytes),
        "pickle_reference_cpu_s": min(reference),
    }
    out["reports_per_cpu_s"] = world_size / max(1e-9, out["reports_poll_cpu_s"] + out["driver_update_cpu_s"])
    # one step/s per rank, one heartbeat round/s, one driver poll/s, two status watchers at 0.5 s
    out["status_cpu_per_wall_s"] = out["status_cpu_s"] + 3 * out["status_again_cpu_s"]
    out["cpu_per_wall_s"] = (out["heartbeat_round_cpu_s"] + out["reports_poll_cpu_s"] + out["driver_update_cpu_s"]
                             + out["status_cpu_per_wall_s"])

    # a dead worker: the poll that sees it decides; the next step plans the new group
    group.dead = world_size // 2
    clock.now += 1.0
    group.advance(clock.now)
    out["dead_decide_cpu_s"] = _timed_step(controller)
    assert controller.state is RunState.RESTARTING, controller.state
    out["restart_plan_cpu_s"] = _timed_step(controller)
    assert controller.state is RunState.SCHEDULING and len(groups) == 2
    controller.step()
    group = groups[-1]

    # a hung worker: no progress from one rank; heartbeat rounds once a (simulated) second
    group.hung, group.hung_since = world_size // 3, clock.now
    detected_at, last_step_cpu = None, 0.0
    for _ in range(int(HANG_LIMIT_S) + 10):
        clock.now += 1.0
        group.advance(clock.now)
        last_step_cpu = _timed_step(controller)
        if controller.state is not RunState.RUNNING:
            detected_at = clock.now
            break
    assert detected_at is not None, "the hang was not detected"
    out["hang_detect_sim_s"] = detected_at - group.hung_since
    out["hang_decide_cpu_s"] = last_step_cpu
    out["hang_event_bytes"] = max(len(line) for line in controller.take_update().events)
    clock.now += 1.0
    controller.step()  # the restart
    controller.step()  # scheduling -> running
    group = groups[-1]

    # a resize through the planned-stop handshake: request -> boundary at the next step -> regroup
    target = max(1, world_size // 2)
    controller.submit(ControlRequest(RequestKind.SCALE, workers=target, reason="scale"))
    spent = 0.0
    for _ in range(10):
        clock.now += 1.0
        group.advance(clock.now)
        spent += _timed_step(controller)
        if len(groups) == 4:
            break
    assert len(groups) == 4 and groups[-1].world_size == target, (len(groups), controller.state)
    out["resize_plan_cpu_s"] = spent
    return out


# ---- grpc: the control service under load -----------------------------------------------------------

class _StatusTarget:
    """The ControlTarget the service calls: `ControllerActor.status` over the live controller."""

    def __init__(self, controller: Controller) -> None:
        from rayzero.controller.status_view import RankTable

        self._controller = controller
        self._table = RankTable()

    def status(self) -> Any:
        from rayzero.controller.status_view import run_status

        return run_status(self._controller, "scale", 0.0, self._table)


def _run_controller(controller: Controller, stop: threading.Event,
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


def grpc_section(world_size: int, seconds: float) -> dict[str, Any]:
    import subprocess

    from rayzero.controller.control_server import ControlServer

    groups: list[SimulatedGroup] = []

    def factory(attempt: int, resume: str | None, workers: int) -> SimulatedGroup:
        groups.append(SimulatedGroup(workers, realtime=True))
        return groups[-1]

    controller = _controller(factory, world_size, time.monotonic, None)
    stop = threading.Event()
    thread = _run_controller(controller, stop)
    while controller.state is not RunState.RUNNING:
        time.sleep(0.01)
    groups[-1].advance(time.monotonic())  # every rank's report and heartbeat, built once

    def tick() -> None:  # every rank reports once a second; the driver collects once a second
        while not stop.wait(1.0):
            groups[-1].repeat()
            pickle.dumps(controller.take_update(), protocol=5)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    token = "scale-bench-token"
    server = ControlServer(_StatusTarget(controller), "scale", None, host="127.0.0.1", port=0, token=token).start()
    try:
        time.sleep(2.0)  # a few rounds first
        started, started_cpu = time.monotonic(), cpu()
        done = subprocess.run([sys.executable, __file__, "--grpc-client", server.address, token, str(seconds)],
                              capture_output=True, text=True, timeout=seconds + 120, check=True)
        wall, used = time.monotonic() - started, cpu() - started_cpu
        client = json.loads(done.stdout)
    finally:
        stop.set()
        server.close(grace_s=0)
        thread.join(10)
        ticker.join(5)
    latencies, intervals = client["latencies_s"], client["watch_intervals_s"]
    return {
        "load_average": os.getloadavg()[0],  # p99 on a shared machine moves with it
        "status_p50_s": statistics.median(latencies),
        "status_p99_s": percentile(latencies, 0.99),
        "status_calls": len(latencies),
        "status_ranks": client["ranks"],
        "watch_interval_p50_s": statistics.median(intervals) if intervals else None,
        "watch_interval_max_s": max(intervals) if intervals else None,
        "watch_requested_s": 0.5,
        "controller_process_cpu_per_wall_s": used / wall,
    }


def grpc_client(address: str, token: str, seconds: float) -> None:
    """The client side of `grpc_section`, in its own process (as `rayzero status` is)."""
    from rayzero.control_api.client import ControlClient

    client = ControlClient(address, token, timeout_s=30.0)
    arrivals: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        for _ in client.watch(0.5):
            arrivals.append(time.monotonic())
            if stop.is_set():
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    latencies, ranks = [], 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        ranks = len(client.status().ranks)
        latencies.append(time.monotonic() - started)
        time.sleep(0.02)  # a busy dashboard: 50 calls/s at most
    stop.set()
    watcher.join(3)
    intervals = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    print(json.dumps({"latencies_s": latencies, "watch_intervals_s": intervals, "ranks": ranks}))


# ---- metrics: the driver's metrics writer ------------------------------------------------------------

def metrics_section(world_size: int, steps: int) -> dict[str, Any]:
    from rayzero.driver.metrics_log import MetricsLog

    work = tempfile.mkdtemp(prefix="rayzero-scale-metrics-")
    try:
        log = MetricsLog(Path(work).as_uri(), flush_interval_s=3600.0, rows_per_part=10**9,
                         max_pending_rows=10**9, emit=lambda line: None)
        log.add(scale_sim.report(0, 0))  # the first part pays pyarrow's start-up: not timed
        assert log.flush(600.0)
        reports = [[scale_sim.report(rank, step) for rank in range(world_size)] for step in range(1, steps + 1)]
        started = cpu()
        for batch in reports:
            for item in batch:
                log.add(item)
        add_cpu = cpu() - started
        assert log.flush(600.0)
        written = log.flush_log[-1]
        log.close()
        assert log.rows_written == world_size * steps + 1 and not log.dropped
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "add_cpu_s_per_report": add_cpu / (world_size * steps),
        "part_rows": world_size * steps,
        "part_write_s": written["seconds"],
        "write_s_per_step": written["seconds"] / steps,  # one step of every rank's report
    }


# ---- ray (b): the real RayWorkerGroup against hosted ranks -------------------------------------------

def _wait(predicate: Any, timeout_s: float, what: str) -> float:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:g}s")
        time.sleep(0.005)
    return time.monotonic()


def _controller_window(group: Any, reports: list[int], window_s: float) -> dict[str, Any]:
    """The controller process's CPU over `window_s` of a running group (its step loop, the Ray calls
    and their replies, the driver's polls), at the rate it achieved and scaled to the real rate."""
    calls = scale_sim.CALLS
    time.sleep(3.0)  # every rank's run and the first heartbeat rounds in flight
    calls.clear()
    started, started_cpu, reports[0] = time.monotonic(), cpu(), 0
    time.sleep(window_s)
    wall, used = time.monotonic() - started, cpu() - started_cpu
    total_calls = sum(calls.values())
    relays = len(group._rounds.relays)
    out: dict[str, Any] = {
        "window_s": wall, "relays": relays, "window_calls": dict(calls), "cpu_per_call_s": used / max(1, total_calls),
        "nodes": len({scale_sim.node_of(rank, group.ranks_per_node) for rank in range(group.world_size)}),
        "cpu_per_wall_s_measured": used / wall, "calls_per_s_achieved": total_calls / wall,
        "reports_per_s_achieved": reports[0] / wall, "heartbeat_rounds_per_s": calls.get("collect", 0) / relays / wall}
    # a real run makes one round a second (heartbeat_interval_s) with every rank reporting once a step
    # (1 s here): scaled up when the loaded machine made fewer
    out["cpu_per_wall_s_at_real_rate"] = out["cpu_per_wall_s_measured"] / min(1.0, max(1e-3, out["heartbeat_rounds_per_s"]))
    return out


def small_nodes_section(world_size: int, hosts: int, window_s: float) -> dict[str, Any]:
    """One rank per node ([Note: relays for small nodes]): the controller process's CPU at the real rate
    with a relay per node, as before (`per_node`), and with relays of `RANKS_PER_RELAY` nodes (`grouped`),
    one after the other in the same run; otherwise as the `ray` section's window."""
    from rayzero.controller.relay_rounds import RANKS_PER_RELAY

    out: dict[str, Any] = {"hosts": hosts, "ranks_per_node": 1,
                           "per_node": _single_rank_nodes(world_size, hosts, 1, window_s),
                           "grouped": _single_rank_nodes(world_size, hosts, RANKS_PER_RELAY, window_s)}
    out["cpu_per_wall_s_at_real_rate"] = out["grouped"]["cpu_per_wall_s_at_real_rate"]
    out["per_node_cpu_per_wall_s_at_real_rate"] = out["per_node"]["cpu_per_wall_s_at_real_rate"]
    return out


def _poll_as_the_driver(controller: Controller, stop: threading.Event) -> list[int]:
    """fit's _stream in a thread: one poll of the controller a second, the reply pickled as Ray does;
    the reports it took counted in the returned one-item list (reset by `_controller_window`)."""
    reports = [0]

    def driver() -> None:
        while not stop.wait(1.0):
            update = controller.take_update()
            reports[0] += len(update.reports)
            pickle.dumps(update, protocol=5)

    threading.Thread(target=driver, daemon=True).start()
    return reports


def _single_rank_nodes(world_size: int, hosts: int, per_relay: int, window_s: float) -> dict[str, Any]:
    """The controller's window over `world_size` single-rank nodes, `per_relay` nodes to a relay."""
    groups: list[Any] = []

    def factory(attempt: int, resume: str | None, workers: int) -> Any:
        groups.append(scale_sim.HostedRayWorkerGroup(workers, hosts, ranks_per_node=1, per_relay=per_relay))
        return groups[-1]

    controller = _controller(factory, world_size, time.monotonic, None)
    stop = threading.Event()
    thread = _run_controller(controller, stop)
    reports = _poll_as_the_driver(controller, stop)
    try:
        _wait(lambda: controller.state is RunState.RUNNING, 300, "the group running")
        return _controller_window(groups[-1], reports, window_s)
    finally:
        controller.submit(ControlRequest(RequestKind.KILL, reason="benchmark done"))
        stop.set()
        thread.join(30)
        for group in groups:
            group.shutdown()


def ray_section(world_size: int, hosts: int, window_s: float, hang_timeout_s: float) -> dict[str, Any]:
    import signal

    groups: list[Any] = []
    made_at: list[float] = []

    def factory(attempt: int, resume: str | None, workers: int) -> Any:
        made_at.append(time.monotonic())
        group = (scale_sim.HostedRayWorkerGroup(workers, hosts) if attempt < 3
                 else SimulatedGroup(workers, realtime=True))  # after the resize: nothing more to measure
        groups.append(group)
        return group

    controller = _controller(factory, world_size, time.monotonic, None, hang_timeout_s=hang_timeout_s)
    stop = threading.Event()
    transitions: list[tuple[float, RunState]] = []
    thread = _run_controller(controller, stop, transitions)

    def left_running(since: float) -> float:
        """When the controller first left RUNNING after `since` (the step that decided on the fault)."""
        _wait(lambda: any(at >= since and state is not RunState.RUNNING for at, state in transitions), 600,
              "the controller acting on the fault")
        return next(at for at, state in transitions if at >= since and state is not RunState.RUNNING)

    reports = _poll_as_the_driver(controller, stop)
    out: dict[str, Any] = {"hosts": hosts, "hang_timeout_s": hang_timeout_s}
    try:
        running = lambda attempt: lambda: controller.state is RunState.RUNNING and controller.attempt == attempt
        _wait(running(0), 300, "the first group running")
        out.update(_controller_window(groups[-1], reports, window_s))

        group = groups[-1]
        os.kill(group.victim_pid, signal.SIGSTOP)  # a hang outside Python: no heartbeat answers at all
        stopped_at = time.monotonic()
        try:
            acted = left_running(stopped_at)
        finally:
            os.kill(group.victim_pid, signal.SIGCONT)
        # decided: find_hang fired and the controller asked for every rank's stacks; acted: the
        # hang report (stacks, py-spy for the silent rank) is made and the failure handled
        out["hang_detect_s"] = group.stacks_asked_at - stopped_at
        out["hang_detect_overhead_s"] = out["hang_detect_s"] - hang_timeout_s
        out["hang_report_s"] = acted - group.stacks_asked_at
        _wait(lambda: len(made_at) >= 2, 300, "the restart after the hang")
        out["hang_restart_plan_s"] = made_at[1] - acted

        _wait(running(1), 300, "the second group running")
        time.sleep(2.0)
        group = groups[-1]
        os.kill(group.victim_pid, signal.SIGKILL)  # a crashed worker process
        killed_at = time.monotonic()
        detected = left_running(killed_at)
        out["dead_detect_s"] = detected - killed_at
        _wait(lambda: len(made_at) >= 3, 300, "the restart after the death")
        out["dead_restart_plan_s"] = made_at[2] - detected

        _wait(running(2), 300, "the third group running")
        time.sleep(2.0)
        requested = time.monotonic()
        controller.submit(ControlRequest(RequestKind.SCALE, workers=world_size - 1, reason="scale"))
        _wait(lambda: len(made_at) >= 4, 300, "the resize")
        out["resize_s"] = made_at[3] - requested  # includes waiting for the next step boundary (<= 1 s)
        controller.submit(ControlRequest(RequestKind.KILL, reason="benchmark done"))
    finally:
        stop.set()
        thread.join(30)
        for group in groups:
            if isinstance(group, scale_sim.HostedRayWorkerGroup):
                group.shutdown()
    return out


# ---- growth exponents, targets, plot -----------------------------------------------------------------

# (section, key) -> what the plot and the exponent table call it; every one should grow at most linearly
GROWING = {
    ("logic", "heartbeat_round_cpu_s"): "controller CPU per heartbeat round",
    ("logic", "reports_poll_cpu_s"): "controller CPU per poll of N reports",
    ("logic", "driver_update_cpu_s"): "controller CPU per driver poll (pickled)",
    ("logic", "status_cpu_s"): "status, first call of a round",
    ("logic", "status_again_cpu_s"): "status, later calls of the round",
    ("logic", "dead_decide_cpu_s"): "decide on a dead rank",
    ("logic", "restart_plan_cpu_s"): "plan the restart (registry scans)",
    ("logic", "hang_decide_cpu_s"): "decide on a hang (stacks, message)",
    ("logic", "resize_plan_cpu_s"): "resize through the planned stop",
    ("logic", "pickle_reference_cpu_s"): "reference: pickling N reports (linear by construction)",
    ("grpc", "status_p50_s"): "GetStatus p50 under load",
    ("grpc", "status_p99_s"): "GetStatus p99 under load",
    ("metrics", "write_s_per_step"): "metrics.parquet write per step of N rows",
    ("checkpoint", "commit_s"): "commit of N shards (leader), wall",
    ("checkpoint", "save_cpu_s"): "commit of N shards (leader), CPU",
    ("checkpoint", "manifest_bytes"): "manifest bytes",
    ("checkpoint", "registry_scan_cpu_s"): "registry scan, cold (2 checkpoints), CPU",
    ("checkpoint", "tracker_failure_scans_s"): "registry scans per failure, warm",
    ("checkpoint", "load_inventory_per_rank_bytes"): "a load's inventory, bytes each rank receives (node-local)",
    ("checkpoint", "shared_load_inventory_per_rank_bytes"): "a load's inventory, bytes each rank receives (shared storage)",
    ("ray", "cpu_per_wall_s_at_real_rate"): "controller process CPU/s, a round a second (b)",
    ("ray", "dead_detect_s"): "dead rank detected, wall (b)",
    ("ray", "hang_detect_s"): "hang detected (limit 30 s), wall (b)",
    ("ray", "resize_s"): "resize, wall (b)",
    ("small_nodes", "cpu_per_wall_s_at_real_rate"): "controller process CPU/s, single-rank nodes, relays of 8 nodes (b)",
    ("small_nodes", "per_node_cpu_per_wall_s_at_real_rate"): "the same with a relay per node (before)",
}


def exponent(sizes: list[int], values: list[float]) -> float | None:
    """Least-squares slope of log(value) on log(N); None with fewer than two positive points."""
    points = [(math.log(n), math.log(v)) for n, v in zip(sizes, values) if v is not None and v > 0]
    if len(points) < 2:
        return None
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    denominator = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / denominator if denominator else None


def series(rows: list[dict[str, Any]], section: str, key: str) -> tuple[list[int], list[float]]:
    found = [(row["n"], row[section][key]) for row in rows
             if isinstance(row.get(section), dict) and isinstance(row[section].get(key), (int, float))]
    return [n for n, _ in found], [value for _, value in found]


def exponents(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    return {f"{section}.{key}": exponent(*series(rows, section, key)) for section, key in GROWING}


def targets(rows: list[dict[str, Any]], slopes: dict[str, float | None]) -> list[dict[str, Any]]:
    at = next((row for row in rows if row["n"] == TARGETS_AT), None)

    def value(section: str, key: str) -> float | None:
        return at.get(section, {}).get(key) if at is not None and isinstance(at.get(section), dict) else None

    def check(name: str, figure: float | None, limit: float, note: str = "") -> dict[str, Any]:
        return {"target": name, "value": figure, "limit": limit, "met": figure is not None and figure <= limit,
                **({"note": note} if note else {})}

    # a stopped process is counted silent from its last answer, up to one round before it stopped, so
    # the overhead can be negative: counted as 0 here (the design bound is one heartbeat interval)
    overhead = value("ray", "hang_detect_overhead_s")
    overhead = None if overhead is None else max(0.0, overhead)
    out = [
        check(f"dead worker detected <= 10 s at {TARGETS_AT}", value("ray", "dead_detect_s"), 10.0),
        check(f"hang detected <= 60 s at {TARGETS_AT} (default hang_timeout_s {HANG_LIMIT_S:g} + the measured "
              "overhead past the limit)", None if overhead is None else HANG_LIMIT_S + overhead, 60.0,
              "detection is hang_timeout_s plus the overhead; met at the default only if hang_timeout_s leaves room"),
        check(f"hang reported (every rank's stacks read) and the restart begun <= 60 s at {TARGETS_AT} (the same, "
              "+ the report)", None if overhead is None or value("ray", "hang_report_s") is None
              else HANG_LIMIT_S + overhead + value("ray", "hang_report_s"), 60.0),
        check(f"GetStatus p99 <= 100 ms at {TARGETS_AT}", value("grpc", "status_p99_s"), 0.100),
        check(f"controller <= 1 core at {TARGETS_AT} (its process in (b) at one round a second, + two "
              "status watchers from (a))",
              None if value("ray", "cpu_per_wall_s_at_real_rate") is None
              or value("logic", "status_cpu_per_wall_s") is None
              else value("ray", "cpu_per_wall_s_at_real_rate") + value("logic", "status_cpu_per_wall_s"), 1.0),
        check(f"checkpoint commit <= 2 s at {TARGETS_AT}", value("checkpoint", "commit_s"), 2.0),
        check(f"controller <= 1 core at {TARGETS_AT} single-rank nodes (its process in (b) at one round a "
              "second, relays of 8 nodes, + two status watchers from (a))",
              None if value("small_nodes", "cpu_per_wall_s_at_real_rate") is None
              or value("logic", "status_cpu_per_wall_s") is None
              else value("small_nodes", "cpu_per_wall_s_at_real_rate") + value("logic", "status_cpu_per_wall_s"), 1.0),
    ]
    reference = slopes.get("logic.pickle_reference_cpu_s")
    note = (f"linear within {EXPONENT_TOLERANCE}: pickling N reports, linear by construction, fits "
            f"N^{reference:.2f} on this machine (the memory hierarchy)" if reference is not None else "")
    out += [{**check(f"exponent of {name} <= 1", slopes.get(f"{section}.{key}"), 1.0 + EXPONENT_TOLERANCE, note),
             "limit": 1.0, "tolerance": EXPONENT_TOLERANCE} for (section, key), name in GROWING.items()
            if slopes.get(f"{section}.{key}") is not None and not key.startswith(("pickle_reference", "per_node"))]
    return out


def plot(document: dict[str, Any], path: str) -> None:
    """Two log-log panels (the controller's CPU per operation; wall clock, Ray and checkpoints), each
    series labelled with its fitted exponent, and a dashed line of slope 1 for comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(15, 8))
    panels = {0: "controller CPU per operation, (a) and the reference", 1: "wall clock, Ray calls (b), checkpoints"}
    styles = ["-o", "-s", "-^", "-D", "-v", "-P", "-X", "-*", "-<", "->"]
    drawn = [0, 0]
    for (section, key), name in GROWING.items():
        sizes, values = series(document["rows"], section, key)
        if len([v for v in values if v > 0]) < 2:
            continue
        panel = 0 if section == "logic" else 1
        slope = document["exponents"].get(f"{section}.{key}")
        shown = [v / 1e6 for v in values] if key.endswith("bytes") else values
        unit = "MB" if key.endswith("bytes") else "cores" if "per_wall" in key else "s"
        color = plt.get_cmap("tab20")(drawn[panel] % 20)
        axes[panel].plot(sizes, shown, styles[drawn[panel] % len(styles)], color=color, markersize=5,
                         label=f"{name} ({unit}): N^{slope:.2f}")
        drawn[panel] += 1
    for panel, axis in enumerate(axes):
        sizes = [row["n"] for row in document["rows"]]
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        low = axis.get_ylim()[0]
        axis.plot(sizes, [low * 2 * n / sizes[0] for n in sizes], "k--", linewidth=0.8, label="slope 1 (linear)")
        axis.set_xlabel("simulated workers N")
        axis.set_title(panels[panel], fontsize=10)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1, frameon=False)
    figure.suptitle("rayzero's control path against N (bench/scale.py); exponent = least-squares log-log slope")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


# ---- main -----------------------------------------------------------------------------------------------

def run(sizes: list[int], sections: list[str], quick: bool, partial: Any = None) -> dict[str, Any]:
    """Every section at every N; `partial(document)` after each N (what is measured survives a crash)."""
    rows: list[dict[str, Any]] = []
    work = tempfile.mkdtemp(prefix="rayzero-scale-")
    ray_started = False
    try:
        if {"ray", "small_nodes"} & set(sections):
            import ray

            # address="local": a Ray of our own even when another one runs on this machine
            ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR",
                     log_to_driver=False)
            ray_started = True
        for world_size in sizes:
            row: dict[str, Any] = {"n": world_size}
            checkpoint_dir = None
            for section in sections:
                print(f"[scale] N={world_size}: {section}", file=sys.stderr, flush=True)
                started = time.monotonic()
                try:
                    if section == "checkpoint":
                        checkpoint_dir = os.path.join(work, f"checkpoints-{world_size}")
                        row[section] = checkpoint_section(world_size, checkpoint_dir)
                    elif section == "logic":
                        row[section] = logic_section(world_size, checkpoint_dir, rounds=3 if quick else 15)
                    elif section == "grpc":
                        row[section] = grpc_section(world_size, 4.0 if quick else 20.0)
                    elif section == "metrics":
                        row[section] = metrics_section(world_size, steps=5)
                    elif section == "small_nodes":
                        row[section] = small_nodes_section(world_size, hosts=2 if quick else 4,
                                                           window_s=3.0 if quick else 8.0)
                    elif section == "ray":
                        # the limit is max(hang_timeout_s, 10 x the 1 s step); 30 s leaves the overloaded
                        # hosts (thousands of ranks on 2 shared cores) time to answer the others' heartbeats
                        row[section] = ray_section(world_size, hosts=2 if quick else 4, window_s=3.0 if quick else 8.0,
                                                   hang_timeout_s=30.0)
                except Exception as error:  # noqa: BLE001 - a failed section is a row, the run goes on
                    import traceback

                    row[section] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
                if isinstance(row[section], dict):
                    row[section]["section_wall_s"] = time.monotonic() - started
                    # the machine is shared: wall-clock figures move with its 1-minute load average
                    row[section].setdefault("load_average", os.getloadavg()[0])
            if checkpoint_dir:
                shutil.rmtree(checkpoint_dir, ignore_errors=True)
            rows.append(row)
            if partial is not None:
                partial(_document(sizes, sections, rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if ray_started:
            import ray

            ray.shutdown()
    return _document(sizes, sections, rows)


def _document(sizes: list[int], sections: list[str], rows: list[dict[str, Any]]) -> dict[str, Any]:
    slopes = exponents(rows)
    return {
        "benchmark": "scale",
        "sizes": sizes,
        "sections": sections,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average at the end "
                   f"{os.getloadavg()[0]:.1f}; Python {platform.python_version()}",
        "rows": rows,
        "exponents": slopes,
        "targets": targets(rows, slopes),
    }


def merged(earlier: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """`earlier` with the sections `now` measured put in its rows (by N): what each section's rows say
    comes from one run of that section; the commands that made them are listed."""
    rows = {row["n"]: dict(row) for row in earlier["rows"]}
    for row in now["rows"]:
        rows.setdefault(row["n"], {"n": row["n"]}).update({key: value for key, value in row.items() if key != "n"})
    ordered = [rows[n] for n in sorted(rows)]
    document = _document(sorted(rows), list(dict.fromkeys([*earlier["sections"], *now["sections"]])), ordered)
    document["machine"] = f"{earlier.get('machine')}; {', '.join(now['sections'])}: {now['machine']}"
    document["command"] = "; ".join(dict.fromkeys([*earlier.get("command", "").split("; "), now["command"]]))
    return document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help=f"comma-separated N (default {','.join(map(str, SIZES))})")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, short windows (a smoke run)")
    parser.add_argument("--json", default=None, help="write the JSON here too")
    parser.add_argument("--plot", default=None, help="write the log-log plot (PNG) here")
    parser.add_argument("--doc", default=None, help="regenerate the tables of this doc from bench/results")
    parser.add_argument("--check", action="store_true", help="with --doc: fail if the doc's tables are stale")
    parser.add_argument("--update", default=None, metavar="JSON",
                        help="merge the sections measured now into this earlier result (rows by N), exponents "
                             "and targets recomputed; written back with --json")
    parser.add_argument("--grpc-client", nargs=3, metavar=("ADDRESS", "TOKEN", "SECONDS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.grpc_client:
        grpc_client(args.grpc_client[0], args.grpc_client[1], float(args.grpc_client[2]))
        return 0
    if args.doc:
        from bench import scale_model

        return scale_model.write_or_check(args.doc, args.check)
    sizes = [int(n) for n in args.sizes.split(",")] if args.sizes else list(QUICK_SIZES if args.quick else SIZES)
    sections = [name for name in args.sections.split(",") if name]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
    command = "python bench/scale.py " + " ".join(sys.argv[1:] if argv is None else argv)

    # read once: --json may name the same file, rewritten after each N
    earlier = json.loads(Path(args.update).read_text()) if args.update else None

    def complete(document: dict[str, Any]) -> dict[str, Any]:
        document["command"] = command
        return merged(earlier, document) if earlier is not None else document

    def save(document: dict[str, Any]) -> str:
        text = json.dumps(complete(document), indent=1)
        if args.json:
            Path(args.json).write_text(text + "\n")
        return text

    document = run(sizes, sections, args.quick, partial=save)
    print(save(document))
    if args.plot:
        plot(complete(document), args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
