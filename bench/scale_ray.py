"""bench/scale.py's `ray` (b) and `small_nodes` sections: the real `RayWorkerGroup` code against hosted
ranks (bench/scale_sim.py's `HostedRayWorkerGroup`), the controller stepping in a thread at the real
rate (bench/scale.py's module docstring says what is measured)."""
from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from typing import Any

from bench import scale_sim
from bench.scale_sim import SimulatedGroup, controller_over, cpu, run_controller
from rayzero.controller.controller import Controller
from rayzero.controller.requests import ControlRequest, RequestKind
from rayzero.controller.states import RunState


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

    controller = controller_over(factory, world_size, time.monotonic, None)
    stop = threading.Event()
    thread = run_controller(controller, stop)
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

    groups: list[Any] = []
    made_at: list[float] = []

    def factory(attempt: int, resume: str | None, workers: int) -> Any:
        made_at.append(time.monotonic())
        group = (scale_sim.HostedRayWorkerGroup(workers, hosts) if attempt < 3
                 else SimulatedGroup(workers, realtime=True))  # after the resize: nothing more to measure
        groups.append(group)
        return group

    controller = controller_over(factory, world_size, time.monotonic, None, hang_timeout_s=hang_timeout_s)
    stop = threading.Event()
    transitions: list[tuple[float, RunState]] = []
    thread = run_controller(controller, stop, transitions)

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
