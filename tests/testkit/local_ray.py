"""Local Ray clusters for the tests, each on ports of its own.

[Note: one dashboard-agent port per Ray]
Ray 2.60 gives a head's dashboard agent the fixed HTTP port 52365, and `ray.init` has no argument to
change it. A second head on the machine (a `rayzero run` subprocess while the tests' shared Ray is up,
or another pytest-xdist worker's Ray) cannot bind it: its agent retries for ~3.4 s, gives its HTTP
server up, and only then does the raylet register, so that start-up is ~3.4 s slower (measured in the
agent and raylet logs; rayzero never talks to the agent's HTTP server). Those seconds count against
the ~15 s the raylet gives its agent ([Note: Ray's start-up bounds] in rayzero/driver/startup.py). The
heads the tests start themselves give their agent port 0 (`ray.cluster_utils.Cluster` passes the
argument on; the agent binds a port the kernel picks, with no window between a pick and the bind, and
Ray reads it back), so 52365 stays free for what the product starts with `ray.init(address="local")`.
Ray gives the nodes that join a `Cluster` port 0 itself.

A head started this way is otherwise what `ray.init(address="local")` starts: token authentication
turned on the same way (Ray's own two calls: RAY_AUTH_MODE=token in this process's environment,
which subprocesses inherit, and a token in ~/.ray/auth_token), the object store Ray's default
would be here at least (`Cluster` alone would give 150 MiB).
"""
from __future__ import annotations

import time
from typing import Any

from bench.chaos_world import add_node_retrying

STARTUP_TRIES = 2
"""Starts of a local Ray whose head came up without a working log monitor (`_log_monitor_problem`);
a head that misses Ray's start-up bounds is tried again within each (bench/chaos_world.py's
`add_node_retrying`), said aloud either way."""


def own_ports() -> dict[str, int]:
    """Node arguments for the ports Ray would otherwise fix (see [Note: one dashboard-agent port per Ray])."""
    return {"dashboard_agent_listen_port": 0}


def add_node(cluster, **node_args):
    """`cluster.add_node(**node_args)` (its head first), started afresh while the node misses Ray's
    start-up bounds: the tests' clusters start on a loaded machine, where heads and joining nodes both
    missed them (bench/chaos_world.py's `add_node_retrying`)."""
    return add_node_retrying(cluster, "a Ray node", tag="[tests]", **node_args)


def start_cluster(num_cpus: int, *, object_store_memory: int = 2 * 1024**3, **head_args: Any):
    """A `ray.cluster_utils.Cluster` with its head started (not connected): `num_cpus` logical CPUs,
    the dashboard off unless `head_args` say otherwise, and its own ports."""
    from ray._private.authentication.authentication_token_setup import (
        enable_token_auth_by_default,
        ensure_token_if_auth_enabled,
    )
    from ray.cluster_utils import Cluster

    enable_token_auth_by_default()  # what ray.init(address="local") does first
    ensure_token_if_auth_enabled(None, create_token_if_missing=True)
    args = {"num_cpus": num_cpus, "include_dashboard": False, "object_store_memory": object_store_memory,
            **own_ports(), **head_args}
    for attempt in range(1, STARTUP_TRIES + 1):
        cluster = Cluster()
        add_node(cluster, **args)
        problem = _log_monitor_problem(cluster)
        if not problem:
            return cluster
        cluster.shutdown()
        if attempt == STARTUP_TRIES:
            raise RuntimeError(f"a local Ray started without a working log monitor: {problem}")
        print(f"[tests] a local Ray started without a working log monitor ({problem}); starting a fresh one",
              flush=True)
    raise AssertionError("unreachable")


def _log_monitor_problem(cluster) -> str:
    """'' when the head's log monitor runs. Without it no worker's output reaches a driver (Ray's log
    monitor carries the workers' files to the GCS): one shared cluster of one xdist worker came up
    without one in ~150 starts (2026-11-27, no log_monitor file in its session) and every later test
    of that worker that reads its workers' lines failed."""
    from ray._private import ray_constants

    started = cluster.head_node.all_processes.get(ray_constants.PROCESS_TYPE_LOG_MONITOR)
    if not started:
        return "none was started"
    time.sleep(0.2)  # one that cannot start exits at once
    code = started[0].process.poll()
    return "" if code is None else f"it exited with status {code}"



def controller_at_step(run_name: str, step: int, thread, box: dict, timeout_s: float):
    """The controller actor of `run_name` once its status reaches `step`, while the thread running
    `rayzero.fit` is alive (its error, if any, is in `box`)."""
    import time

    import ray

    from rayzero.driver.fit import controller_actor_name

    deadline = time.monotonic() + timeout_s
    controller = None
    while controller is None or ray.get(controller.status.remote()).step < step:
        assert time.monotonic() < deadline and thread.is_alive(), box
        try:
            controller = controller or ray.get_actor(controller_actor_name(run_name))
        except ValueError:
            pass
        time.sleep(0.2)
    return controller, deadline
