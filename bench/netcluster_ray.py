"""A Ray cluster on the emulated nodes of bench/netcluster.py: one Ray node per namespace.

[Note: Ray on emulated nodes]
The head runs in node 0's namespace (`ip netns exec ... ray start --head --node-ip-address
10.77.0.1`), every other node joins it from its own namespace with its own address, and a driver
runs in node 0's namespace too (a Ray driver attaches to a raylet of the cluster; Ray picks the
head's on this host). Each Ray node is told `num_cpus = workers_per_node` and a custom resource
`emu_slot` of the same amount, plus `emu_node_<i>: 1` naming it; a worker asking for
`WORKER_RESOURCES` (one CPU, one slot) lands `workers_per_node` to a node, whatever the placement
strategy. The nodes start with GLOO_SOCKET_IFNAME=emu and RAY_AUTH_MODE=token in their environment:
Ray's workers inherit the raylet's environment, so every rank's gloo binds its own node's address
([Note: emulated nodes]). Ray's own traffic between nodes (GCS heartbeats, the controller's
calls to the other node's relay, objects) crosses the shaped link too, as it would in a cloud: a
measurement reads the counters around the steps it measures.

[Note: Ray starts under load]
A Ray 2.60 raylet waits 15 s for its dashboard agent to write its ports to files and then aborts
("Check failed ... Timed out waiting for file .../dashboard_agent_listen_port...",
`NodeManager::WaitForDashboardAgentPorts`); `ray start` only notices when its own ~60 s bound runs
out. The agent imports ~2 CPU-seconds of Python: on this 2-core machine at load average ~20 (other
sessions' test suites) that took 10 s of wall time before it even started, and 2 of 3 head starts
failed so. Passing every port explicitly (`_fixed_ports`) spares the waits for the ports the raylet
is given, not for the agent's HTTP port, which `ray start` does not pass on. So a node start
watches its raylet's log, ends the node's processes at the first such line and starts it again
(`STARTS` in all), each try said on stderr. That alone did not do: 3 tries of 3 failed at load
~20. The kernel here groups processes by session for scheduling (sched_autogroup_enabled=1: each
session's group gets a fair share, and a process's niceness counts only within its group), so a
node's daemons got ~1/10 of the machine whatever their niceness: the agent's interpreter first
ran 16 s after the raylet launched it. So `ray start` runs in a session of its own, whose group
gets niceness START_NICENESS while the node starts and 0 again once it is up (or given up): the
training workers, which the raylet starts in that group, compete like everyone else's.

Each cluster has its own temp dir, and its ports live in its own namespaces, so a second Ray on
the machine (the tests' shared one, another session's) is never in the way. `stop()` ends the
processes inside the namespaces (`ip netns pids`), never `ray stop`, which would end every Ray on
the machine.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from bench.netcluster import IFNAME, NetCluster, cpu_seconds, end_processes

REPO = Path(__file__).resolve().parent.parent
GCS_PORT = 6379
STARTS = 3
"""Starts of one Ray node before the cluster gives up ([Note: Ray starts under load])."""
START_NICENESS = -10
"""The niceness of a Ray node's scheduler autogroup while it starts ([Note: Ray starts under load])."""
WORKER_RESOURCES = {"CPU": 1.0, "emu_slot": 1.0}
"""resources_per_worker that puts `workers_per_node` ranks on each emulated node."""


def ray_environment() -> dict[str, str]:
    """The environment every Ray process and driver of the emulated cluster gets: token auth (as
    `ray.init()` on this machine turns it on: [Note: one dashboard-agent port per Ray] in
    tests/testkit/local_ray.py) with the token made if missing, this checkout first on the path."""
    from ray._private.authentication.authentication_token_setup import (
        enable_token_auth_by_default,
        ensure_token_if_auth_enabled,
    )

    enable_token_auth_by_default()  # sets RAY_AUTH_MODE=token in this process's environment
    ensure_token_if_auth_enabled(None, create_token_if_missing=True)
    path = [str(REPO), str(REPO / "operators"), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {**os.environ, "RAY_AUTH_MODE": "token", "GLOO_SOCKET_IFNAME": IFNAME,
            "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)), "RAY_USAGE_STATS_ENABLED": "0",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


@dataclass
class RayOnNet:
    """Ray nodes on `cluster`'s namespaces; `start()` / `stop()` (or a context manager)."""

    cluster: NetCluster
    workers_per_node: int = 2
    object_store_bytes: int = 256 * 1024**2
    start_timeout_s: float = 90.0
    temp_dir: str = ""
    env: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    cpu_s: float = 0.0

    @property
    def address(self) -> str:
        return f"{self.cluster.address(0)}:{GCS_PORT}"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> RayOnNet:
        """Start the head, then each other node; a node whose raylet gave up at start-up is started
        again (STARTS times in all: [Note: Ray starts under load])."""
        self.env = ray_environment()
        self.temp_dir = tempfile.mkdtemp(prefix=f"{self.cluster.prefix}-", dir="/tmp")
        started = time.monotonic()
        try:
            for node in range(self.cluster.nodes):
                for attempt in range(1, STARTS + 1):
                    problem = self._start_node(node, attempt)
                    if not problem:
                        break
                    end_processes([self.cluster.namespace(node)], grace_s=2.0)
                    if attempt == STARTS:
                        raise RuntimeError(f"`ray start` on emulated node {node} failed {STARTS} times; the last: "
                                           f"{problem}")
                    print(f"[netcluster] `ray start` on emulated node {node} failed ({problem.splitlines()[0]}); "
                          "starting it again", file=sys.stderr, flush=True)
                self.timings[f"node{node}_start_s"] = time.monotonic() - started
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, node: int, attempt: int) -> str:
        """'' once `ray start` on `node` succeeded, else what went wrong."""
        resources = {"emu_slot": self.workers_per_node, f"emu_node_{node}": 1}
        where = ["--head", "--port", str(GCS_PORT), "--include-dashboard", "false"] if node == 0 else [
            "--address", self.address]
        node_dir = Path(self.temp_dir) / f"n{node}.{attempt}"  # a failed try's logs stay apart
        argv = [str(Path(sys.executable).with_name("ray")), "start", *where,
                "--node-ip-address", self.cluster.address(node),
                "--num-cpus", str(self.workers_per_node), "--resources", json.dumps(resources),
                "--object-store-memory", str(self.object_store_bytes), "--temp-dir", str(node_dir),
                "--disable-usage-stats", *_fixed_ports()]
        log = Path(self.temp_dir) / f"ray-start-n{node}.{attempt}.log"
        with log.open("w") as out:
            # a session of its own: the node's daemons form one scheduler autogroup
            process = subprocess.Popen(self.cluster.exec_argv(node, argv), env=self.env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        _set_autogroup_nice([process.pid], START_NICENESS)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while process.poll() is None:
                crash = _raylet_crash(node_dir)
                if crash or time.monotonic() > deadline:
                    process.kill()
                    process.wait()
                    return crash or f"no answer within {self.start_timeout_s:g} s"
                time.sleep(0.5)
        finally:
            _set_autogroup_nice(_namespace_pids(self.cluster.namespace(node)), 0)
        if process.returncode != 0:
            return f"exit {process.returncode}: {_raylet_crash(node_dir) or log.read_text()[-2000:]}"
        return ""

    def stop(self) -> None:
        """End the Ray processes (every process in the namespaces: [Note: Ray on emulated nodes]) and
        delete the cluster's namespaces and temp dir. `cpu_s`: what the nodes' processes used."""
        names = [self.cluster.namespace(node) for node in range(self.cluster.nodes)]
        self.cpu_s = cpu_seconds(names)
        self.cluster.down()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def driver(self, argv: list[str], timeout_s: float, extra_env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess:
        """Run `argv` (a driver) in node 0's namespace with RAY_ADDRESS set to the head."""
        env = {**self.env, "RAY_ADDRESS": self.address, **(extra_env or {})}
        return subprocess.run(self.cluster.exec_argv(0, argv), env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)


def _fixed_ports() -> list[str]:
    """Every port a Ray node would otherwise choose at start-up, fixed: a node's ports live in its
    own namespace, so they cannot clash, and a raylet given a port does not wait for a port file
    ([Note: Ray starts under load])."""
    ports = {"--node-manager-port": 61001, "--object-manager-port": 61002, "--dashboard-agent-grpc-port": 61003,
             "--dashboard-agent-listen-port": 61004, "--runtime-env-agent-port": 61005,
             "--metrics-export-port": 61006}
    return [part for flag, port in ports.items() for part in (flag, str(port))]


def _namespace_pids(namespace: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False)
    return [int(pid) for pid in done.stdout.split() if pid.isdigit()]


def _set_autogroup_nice(pids: list[int], niceness: int) -> None:
    """The niceness of the scheduler autogroups of `pids` (/proc/PID/autogroup; nothing where the
    kernel has no autogroups or the process is gone)."""
    for pid in pids:
        try:
            Path(f"/proc/{pid}/autogroup").write_text(str(niceness))
        except OSError:
            pass


def _raylet_crash(node_dir: Path) -> str:
    """The raylet's fatal line when it gave up at start-up (its log under `node_dir`), else ''."""
    for path in node_dir.glob("session_*/logs/raylet*.out"):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if "Check failed" in line or "Timed out waiting for file" in line:
                return line[line.find("Check failed"):][:300] if "Check failed" in line else line[:300]
    return ""


def wait_for_nodes(count: int, timeout_s: float = 60.0) -> list[dict]:
    """In a driver connected to the cluster: wait until `count` nodes are alive; return them."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        alive = [node for node in ray.nodes() if node["Alive"]]
        if len(alive) >= count:
            return alive
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(alive)} of {count} emulated Ray nodes joined within {timeout_s:g} s")
        time.sleep(0.2)
