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

from bench import scale_sim
from bench.scale_checkpoint import checkpoint_section
from bench.scale_ray import ray_section, small_nodes_section
from bench.scale_report import HANG_LIMIT_S, exponents, plot, targets
from bench.scale_sim import SimulatedGroup, controller_over, cpu, run_controller
from rayzero.controller.controller import Controller
from rayzero.controller.requests import ControlRequest, RequestKind
from rayzero.controller.states import RunState

SIZES = (64, 256, 1024, 4096)
QUICK_SIZES = (16, 64)
SECTIONS = ("checkpoint", "logic", "grpc", "metrics", "ray", "small_nodes")


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


# ---- logic (a): the controller over a simulated group, on a simulated clock ------------------------

class SimClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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

    controller = controller_over(factory, world_size, clock, checkpoint_dir)
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


def grpc_section(world_size: int, seconds: float) -> dict[str, Any]:
    import subprocess

    from rayzero.controller.control_server import ControlServer

    groups: list[SimulatedGroup] = []

    def factory(attempt: int, resume: str | None, workers: int) -> SimulatedGroup:
        groups.append(SimulatedGroup(workers, realtime=True))
        return groups[-1]

    controller = controller_over(factory, world_size, time.monotonic, None)
    stop = threading.Event()
    thread = run_controller(controller, stop)
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
