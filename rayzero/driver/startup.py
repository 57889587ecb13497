"""Starting a Ray node on a busy machine: Ray's start-up bounds, and a fresh node when one is missed.

[Note: Ray's start-up bounds]
A Ray node (the head `ray.init(address="local")` starts, a `Cluster.add_node`, `ray start`) is up
once its raylet registers with the GCS. Ray 2.60 bounds that twice, and neither bound can be set:
- the raylet registers only after its dashboard agent (a Python process that imports nearly every
  dashboard module: ~2.2 CPU-s here) has bound its ports, and waits ~15 s for them
  (node_manager.cc's WaitForDashboardAgentPorts); then it aborts ("Timed out waiting for file
  .../dashboard_agent_listen_port_..." in raylet.err);
- the process starting the node waits 30 s for the registration (ray/_private/node.py), then raises
  "The current node timed out during startup";
- a head also waits 60 s (RAY_DASHBOARD_STARTUP_TIMEOUT_S) for its dashboard process to publish its
  address, then fails ("Failed to start the dashboard"; a fresh clone's `make test`, 2026-11-28).
Measured on the 2-core machine while other sessions kept its load average at 20-23 (2026-11-28): an
agent alone took 10-11 s to import; at a node's start, beside the GCS, the monitor, the log monitor
and the runtime-env agent, it took 15-26 s, and three starts in four missed the bound.
RAY_raylet_start_wait_time_s (which Ray's GCS message suggests) lengthens only the GCS look-up, not
the raylet's wait for its agent: with it at 90 s (and RAY_agent_register_timeout_ms at 90000) the raylet
still aborted 15.3 s after starting an agent that took 25 s, and the failure surfaced after 115 s
instead of ~50.

So a start that misses them is tried again with a fresh node (`start_retrying`), a bounded number of
times, said aloud. The failed node is stopped first: Ray leaves its processes running (its GCS,
monitor and log monitor, and an agent still importing, which outlives its raylet), and they would
compete with the fresh node for the same CPU. Its processes are found exactly: the `Node` whose
start raised (Ray's own list of what it started) and every process naming its node id (the agents
its raylet started: `--node-id=...`), never by a process name, nor by the session directory, which
the nodes of a `ray.cluster_utils.Cluster` share.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from rayzero.config.errors import RayZeroRuntimeError
from rayzero.driver.say import say

Started = TypeVar("Started")

MISSED_BOUND = "timed out during startup"
"""What Ray's exception says when a node missed its start-up bounds (ray/_private/node.py)."""
DASHBOARD_FAILED = "Failed to start the dashboard"
"""What a head's start logs when its dashboard process did not publish its address within
RAY_DASHBOARD_STARTUP_TIMEOUT_S (60 s; ray/_private/services.py `start_api_server`). The exception
that follows says different things by what the dashboard had logged by then, so a start is known to
have failed there by the frame it was raised from."""


def missed_startup_bound(error: BaseException) -> bool:
    """Whether a node's start failed on one of Ray's start-up bounds: the raylet's registration, or the
    head's dashboard (which even `include_dashboard=False` starts, with fewer modules)."""
    if MISSED_BOUND in str(error):
        return True
    trace = error.__traceback__
    while trace is not None:
        if trace.tb_frame.f_code.co_name == "start_api_server":
            return True
        trace = trace.tb_next
    return False


def stop_unfinished_node(error: BaseException) -> str:
    """Stop every process of the node whose start raised `error`; its node id, or '' when the
    traceback holds no node (then nothing is stopped)."""
    from ray._private.node import Node

    node = None
    trace = error.__traceback__
    while trace is not None:  # Node.__init__'s frame: its `self` is the half-started node
        candidate = trace.tb_frame.f_locals.get("self")
        if isinstance(candidate, Node):
            node = candidate
        trace = trace.tb_next
    if node is None:
        return ""
    node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
    for pid in processes_naming(node.node_id):  # 56 random hex digits: nothing else names them
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return node.node_id


def processes_naming(text: str) -> list[int]:
    """The processes (other than this one) whose command line contains `text`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours to read
                continue
    return pids


class StartupBoundError(RayZeroRuntimeError):
    """A Ray node missed Ray's start-up bounds on every try."""


def start_retrying(start: Callable[[], Started], who: str, tries: int, tag: str = "[rayzero]") -> Started:
    """`start()`, tried up to `tries` times while it misses Ray's start-up bounds, each failed node
    stopped ([Note: Ray's start-up bounds]); `who` names the node in the lines (`tag` first) and the
    error that say so."""
    for attempt in range(1, tries + 1):
        try:
            return start()
        except Exception as error:  # Ray raises a bare Exception for a missed bound
            if not missed_startup_bound(error):
                raise
            stopped = "its processes stopped" if stop_unfinished_node(error) else "no node to stop"
            if attempt == tries:
                raise StartupBoundError(
                    f"{who} missed Ray's start-up bounds {tries} times ({error}; {stopped}): the machine is too "
                    "busy for Ray to start a node (its dashboard agent gets ~15 s). Run again when fewer "
                    "processes compete for the CPU, or start Ray yourself (`ray start --head`) and join it "
                    "with RAY_ADDRESS") from error
            say(f"{tag} {who} missed Ray's start-up bounds (try {attempt} of {tries}; the machine is busy: Ray "
                f"gives a node's dashboard agent ~15 s to start): {stopped}, starting a fresh one")
    raise AssertionError("unreachable")
