"""StallWatch.close() joins its waiting thread when the thread is idle, and lets go of one still
stuck in a wait that timed out ([Note: stalled stage-3 collectives])."""
from __future__ import annotations

import threading
import time

import pytest

from rayzero.engine.stage3.stall import StallWatch

pytestmark = pytest.mark.unit


class FutureLessWork:
    """A pending collective without a future, as gloo's reduce-scatter: waited on in a thread."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def is_completed(self) -> bool:
        return False

    def get_future(self):
        raise RuntimeError("this Work has no future")

    def wait(self) -> bool:
        self.release.wait()
        return True


def _waiting_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("rayzero-stage3-wait")]


def test_close_after_finished_waits_leaves_no_thread_behind() -> None:
    watch = StallWatch(None, 0, 2, lambda: (0, "m", False))
    watch.seconds = 5.0
    done = threading.Event()
    done.set()
    for _ in range(3):
        watch.wait(FutureLessWork(done))
    assert _waiting_threads()
    watch.close()
    assert _waiting_threads() == []  # joined, not merely told to stop


def test_close_does_not_wait_for_a_thread_stuck_in_a_wait_that_timed_out() -> None:
    watch = StallWatch(None, 0, 2, lambda: (0, "m", False))
    watch.seconds = 0.2
    watch._check = lambda: None  # no process group here: the diagnosis itself is the dist tests'
    stuck = threading.Event()
    waiting = threading.Thread(target=watch.wait, args=(FutureLessWork(stuck),), daemon=True)
    waiting.start()
    deadline = time.monotonic() + 30
    while watch._waiting is None or not watch._waiting.running():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)  # past the watch's 0.2 s: the collective is stalled, its thread still in wait()
    closing = threading.Thread(target=watch.close, daemon=True)
    try:
        closing.start()
        closing.join(10)
        assert not closing.is_alive(), "close() waited for a thread stuck in a collective"
        assert _waiting_threads()
    finally:
        stuck.set()
    waiting.join(30)
    for thread in _waiting_threads():
        thread.join(30)
    assert _waiting_threads() == []
