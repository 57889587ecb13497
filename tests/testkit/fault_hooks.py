"""Deterministic fault injection for the fault-matrix tests: SIGKILL this worker process while one of
its threads runs inside a given module of the checkpoint layer (mid-save, mid-load).

The checkpoint layer runs for real; only the moment of the kill is chosen. A watcher thread samples
every thread's Python stack (`sys._current_frames`) each millisecond and kills the process as soon
as one of them is inside `module` (e.g. rayzero/checkpoint/saver.py). The loop keeps the window open
on purpose: the other ranks enter the same collective save or load a second later, so this rank
waits inside it (in the checkpoint layer's first collective) long enough to be seen there. The
watcher writes which function it saw into `marker` first, so a test can tell it hit the window.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path


def kill_inside(module: str, marker: Path, timeout_s: float = 60.0) -> threading.Thread:
    """Start the watcher; `module` is a path suffix such as "rayzero/checkpoint/loader.py"."""
    me = threading.get_ident()

    def inside() -> str | None:
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            while frame is not None:
                # a function of the module, not its import (a lazy import runs its <module> code)
                if frame.f_code.co_filename.endswith(module) and frame.f_code.co_name != "<module>":
                    return f"{frame.f_code.co_name} ({'main' if ident == me else 'background'} thread)"
                frame = frame.f_back
        return None

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            where = inside()
            if where is not None:
                marker.write_text(where)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.001)

    thread = threading.Thread(target=watch, name="fault-hook", daemon=True)
    thread.start()
    return thread
