"""A small in-process ControlTarget for the control-plane tests: a "run" whose step thread advances
a step every `step_s`, saves a checkpoint file set (manifest last, `latest` after) when asked, and
ends on stop/kill. The target is the controller's to implement ([Note: the control seam]); this one
lets the server, auth, streaming, client, CLI and operator be tested for real without Ray."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import threading
import time
from collections.abc import Iterator

import pytest

from rayzero.config.errors import RayZeroRuntimeError, RayZeroValueError
from rayzero.controller.status import CheckpointRecord, RankStatus, RunStatus


class FakeRun:
    def __init__(self, name: str, checkpoint_dir: str, *, world_size: int = 2, min_workers: int = 1,
                 max_workers: int = 4, step_s: float = 0.05, max_failures: int = 3) -> None:
        self.name = name
        self.checkpoint_dir = checkpoint_dir
        self.world_size, self.min_workers, self.max_workers = world_size, min_workers, max_workers
        self.max_failures = max_failures
        self.step_s = step_s
        self.state = "running"
        self.step = 0
        self.started_at = time.time()
        self.checkpoints: list[CheckpointRecord] = []
        self.scaled_to: list[int] = []
        self.killed: str | None = None
        self._save_requested = threading.Event()
        self._stop_requested = False
        self._saved = threading.Condition()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while self.state == "running":
            time.sleep(self.step_s)
            self.step += 1
            if self._save_requested.is_set():
                self._save()
                self._save_requested.clear()
                if self._stop_requested:
                    self.state = "finished"
        with self._saved:
            self._saved.notify_all()

    def _save(self) -> None:
        tag = f"global_step{self.step}"
        directory = os.path.join(self.checkpoint_dir, tag)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "manifest.json"), "w") as handle:
            json.dump({"step": self.step}, handle)
        with open(os.path.join(self.checkpoint_dir, "latest"), "w") as handle:
            handle.write(tag)
        with self._saved:
            self.checkpoints.append(CheckpointRecord("durable", directory, self.step, time.time()))
            self._saved.notify_all()

    # --- ControlTarget ---------------------------------------------------------------------------

    def status(self) -> RunStatus:
        reported = self.step
        return RunStatus(
            run_name=self.name, state=self.state, attempt=0, world_size=self.world_size,
            min_workers=self.min_workers, max_workers=self.max_workers, started_at=self.started_at,
            step=reported, loss=(2.0 / (1 + reported)) if reported else None,
            samples_per_s=100.0 if reported else None, last_report_time=time.time() if reported else 0.0,
            checkpoints=tuple(self.checkpoints[-1:]), failures=0, max_failures=self.max_failures,
            ranks=tuple(RankStatus(rank, f"node{rank}", 0.1, reported, reported, 1 << 20, 2 << 20)
                        for rank in range(self.world_size)),
            message="training", extra={"backend": "gloo"})

    def _wait_for_save(self, after: int, timeout_s: float) -> CheckpointRecord:
        deadline = time.monotonic() + timeout_s
        with self._saved:
            while not any(record.step > after for record in self.checkpoints):
                if self.state != "running" and self._stop_requested is False:
                    raise RayZeroRuntimeError(f"run {self.name} ended ({self.state}) before the checkpoint")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no checkpoint committed within {timeout_s}s")
                self._saved.wait(left)
            return self.checkpoints[-1]

    def checkpoint_now(self, timeout_s: float) -> CheckpointRecord:
        if self.state != "running":
            raise RayZeroRuntimeError(f"run {self.name} is {self.state}, not running: nothing to checkpoint")
        seen = self.step
        self._save_requested.set()
        return self._wait_for_save(seen, timeout_s)

    def stop(self, timeout_s: float) -> CheckpointRecord | None:
        if self.state != "running":
            return None
        seen = self.step
        self._stop_requested = True
        self._save_requested.set()
        record = self._wait_for_save(seen, timeout_s)
        self._thread.join(timeout_s)
        return record

    def scale(self, workers: int) -> None:
        if not self.min_workers <= workers <= self.max_workers:
            raise RayZeroValueError(f"scale to {workers} workers is outside the elastic range "
                                    f"[{self.min_workers}, {self.max_workers}]; pick a size in it")
        self.scaled_to.append(workers)
        self.world_size = workers

    def kill(self, reason: str) -> None:
        self.killed = reason
        self.state = "errored"


@pytest.fixture(autouse=True)
def private_token_directory(tmp_path, monkeypatch):
    """Each test's own token directory (never the user's ~/.rayzero), and no token or CA from outside."""
    monkeypatch.setenv("RAYZERO_CONTROL_TOKEN_DIR", str(tmp_path / "tokens"))
    for variable in ("RAYZERO_CONTROL_TOKEN", "RAYZERO_CONTROL_TLS_CA", "RAYZERO_CONTROL_TLS_CERT",
                     "RAYZERO_CONTROL_TLS_KEY"):
        monkeypatch.delenv(variable, raising=False)
    return tmp_path / "tokens"


@contextlib.contextmanager
def serving(tmp_path, monkeypatch) -> Iterator[tuple[FakeRun, object, pathlib.Path]]:
    """(run, its control server on loopback, the storage root) for run "exp1", control.json under
    <root>/exp1; the run is killed and the server closed afterwards."""
    from rayzero.controller.control_server import ControlServer

    monkeypatch.setenv("RAYZERO_CONTROL_HOST", "127.0.0.1")
    root = tmp_path / "runs"
    run = FakeRun("exp1", str(root / "exp1" / "checkpoints"))
    server = ControlServer(run, "exp1", (root / "exp1").as_uri()).start()
    try:
        yield run, server, root
    finally:
        run.kill("test over")
        server.close(grace_s=0.5)
