"""The controller as a threaded Ray actor: steps in a background thread, long-polled by the driver,
answering the control plane ([Note: the control seam] in status.py)."""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from rayzero.controller.control_server import ControlServer
from rayzero.controller.errors import TrainingFailedError
from rayzero.controller.requests import ControlRequest, RequestKind
from rayzero.controller.status import CheckpointRecord, RunStatus
from rayzero.workers.heap import TRIM_INTERVAL_S, release_free_heap

if TYPE_CHECKING:
    from collections.abc import Callable

    from rayzero.controller.controller import Controller, ControllerUpdate


POLL_BATCH_S = 0.1


class ControllerActor:
    """The controller as a Ray actor (threaded): `start()` runs steps in a thread, `poll()` streams,
    and the `ControlTarget` methods ([Note: the control seam]) take requests from the control plane."""

    def __init__(self, controller_factory: Callable[[], Controller], run_name: str = "",
                 run_directory: str | None = None) -> None:
        self._controller = controller_factory()
        self._started_at = time.time()
        self._thread: threading.Thread | None = None
        self._changed = threading.Event()  # set after each step, wakes a waiting poll
        self._run_name, self._run_directory = run_name, run_directory  # where control.json goes
        self._calls_in_flight = 0  # control calls not yet answered (the driver waits before killing us)
        self._calls_lock = threading.Lock()
        self._answered_at = 0.0
        self._polled_at = 0.0  # when the previous poll answered (POLL_BATCH_S)
        from rayzero.controller.status_view import RankTable

        self._rank_table = RankTable()  # status() rebuilds the ranks once per heartbeat round

    def start(self) -> None:
        import ray

        # The control service (rayzero.v1.Control) serves this actor ([Note: the control seam]).
        self._control = ControlServer(self, self._run_name, self._run_directory,
                                      host=ray.util.get_node_ip_address()).start()
        self._thread = threading.Thread(target=self._loop, name="rayzero-controller", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        controller = self._controller
        trimmed_at = time.monotonic()
        while not controller.state.is_terminal:
            if time.monotonic() - trimmed_at >= TRIM_INTERVAL_S:  # [Note: the allocator's free pages]
                release_free_heap()
                trimmed_at = time.monotonic()
            try:
                controller.step()
            except Exception as error:  # noqa: BLE001 - a controller bug must still end the run with a reason
                import traceback

                controller.fail_with(TrainingFailedError(
                    f"the rayzero controller failed: {type(error).__name__}: {error}",
                    None,
                    traceback.format_exc(),
                ))
            self._changed.set()
        self._control.close()  # control.json goes first; a Stop waiting for this end still gets its answer

    def poll(self, timeout_s: float) -> ControllerUpdate:
        # Reports are batched: a poll answers at most every POLL_BATCH_S, so a fast loop costs the
        # driver a few calls a second, not one per step (each call is Ray work on both sides).
        wait = self._polled_at + POLL_BATCH_S - time.monotonic()
        if wait > 0 and not self._controller.state.is_terminal:
            time.sleep(wait)
        try:
            return self._poll(timeout_s)
        finally:
            self._polled_at = time.monotonic()

    def _poll(self, timeout_s: float) -> ControllerUpdate:
        deadline = time.monotonic() + timeout_s
        while True:
            update = self._controller.take_update()
            if update.state.is_terminal and self._thread is not None:
                self._thread.join(5.0)  # the control service is closed before the driver kills this actor
            if update.reports or update.events or update.state.is_terminal or time.monotonic() >= deadline:
                return update
            self._changed.wait(max(0.0, deadline - time.monotonic()))
            self._changed.clear()

    def quiesce(self, timeout_s: float) -> None:
        """Wait (bounded) until no control call is being answered: the driver calls this before it
        kills the actor, so a `stop()` that ended the run still gets its reply."""
        deadline = time.monotonic() + timeout_s
        # in flight, or answered a moment ago (Ray still sending the reply)
        while (self._calls_in_flight or time.monotonic() - self._answered_at < 0.2) and time.monotonic() < deadline:
            time.sleep(0.02)

    def _answer(self, request: ControlRequest, timeout_s: float) -> Any:
        with self._calls_lock:
            self._calls_in_flight += 1
        try:
            return self._controller.submit(request).wait(timeout_s)
        finally:
            with self._calls_lock:
                self._calls_in_flight -= 1
                self._answered_at = time.monotonic()

    # ---- ControlTarget ----------------------------------------------------------------------
    def status(self) -> RunStatus:
        from rayzero.controller.status_view import run_status

        return run_status(self._controller, self._run_name, self._started_at, self._rank_table)

    def checkpoint_now(self, timeout_s: float) -> CheckpointRecord:
        return self._answer(ControlRequest(RequestKind.CHECKPOINT), timeout_s)

    def stop(self, timeout_s: float) -> CheckpointRecord | None:
        return self._answer(ControlRequest(RequestKind.STOP, reason="stop requested"), timeout_s)

    def scale(self, workers: int) -> None:
        request = self._controller.submit(ControlRequest(RequestKind.SCALE, workers=workers, reason="scale"))
        del request  # accepted; carried out through a planned resize (status() shows it)

    def kill(self, reason: str) -> None:
        self._answer(ControlRequest(RequestKind.KILL, reason=reason), 30.0)
