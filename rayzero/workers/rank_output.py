"""A script's output, line by line, labelled with its rank: `[rank 0] epoch 1 loss 0.52`.

[Note: rank-prefixed output]
Under torchrun every rank writes to the launcher's terminal; `rayzero run SCRIPT.py` runs the script
inside a Ray worker, whose stdout and stderr Ray copies to the driver as `(TrainWorker pid=1234) ...`.
So while a script runs, its worker's file descriptors 1 and 2 point into pipes (C extensions, gloo's
warnings and the script's child processes write there too), and one thread per pipe writes each line
back to the original descriptor as `[rank N] line`. Ray still carries the lines to the driver; the
`rayzero run` command turns Ray's own `(pid=...)` label off there and keeps Ray from folding the
ranks' lines into one ("[repeated 2x across cluster]": its duplicate check ignores words holding
digits, so `[rank 0] x` and `[rank 1] x` would look alike) — see `quiet_ray_log_labels` in
rayzero/driver/cli.py. From `rayzero.fit(rayzero.Script(...))` the lines arrive with Ray's label in
front of ours, as any worker output does.

A line ended by `\\r` (a progress bar redrawing itself) is written at most once a second, so a tqdm
bar shows its progress without a line per redraw. When the script ends, the worker waits a second
before it reports the end, so the end of the run does not overtake the script's last lines: Ray
forwards them asynchronously (its log monitor polls the worker's file, publishes through the GCS,
the driver prints) and the driver exits soon after the run ends (Ray gives pending lines 0.5 s); the
controller also kills the worker processes right away, and a log monitor watching more than
RAY_LOG_MONITOR_MAX_OPEN_FILES (200) files moves a dead worker's file aside without reading its end.
On the loaded 2-core test machine a rank's last line ("FINAL ...") was missing in about one run in
six without the wait. Every line counts as progress for hang detection until the rank's engine first
steps ([Note: scripts on workers] in script.py).
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

# Ray's log monitor reads lines such as `:actor_name:TrainWorker` from a worker's stdout; they pass
# through unlabelled.
_RAY_MAGIC = re.compile(rb"^:[a-z_]+:")
_LINE_ENDS = re.compile(rb"(\r\n|\n|\r)")
_REDRAW_INTERVAL_S = 1.0
_DRAIN_TIMEOUT_S = 2.0  # how long the end of a run waits for the last lines of the pipes
_SETTLE_S = 1.0  # then for Ray's log monitor to read them while this process lives (see the note)


class RankOutput:
    """While active, this process's fd 1 and 2 go through `[rank N] ` labelling (see the note)."""

    def __init__(self, rank: int, on_line: Callable[[], None] | None = None) -> None:
        self._prefix = f"[rank {rank}] ".encode()
        self._on_line = on_line  # called for every line written (the hang detector's progress)
        self._saved: dict[int, int] = {}  # fd -> a duplicate of what it pointed to before
        self._threads: list[threading.Thread] = []
        self._line_buffering: dict[str, bool] = {}

    def __enter__(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd in (1, 2):
            self._saved[fd] = os.dup(fd)
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            thread = threading.Thread(target=self._pump, args=(read_end, self._saved[fd]), daemon=True,
                                      name=f"rayzero-rank-output-{fd}")
            thread.start()
            self._threads.append(thread)
        # Ray's worker writes to a file: block-buffered, a script's print would arrive much later.
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            self._line_buffering[name] = getattr(stream, "line_buffering", True)
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(line_buffering=True)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            stream.flush()
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(line_buffering=self._line_buffering[name])
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)  # closes this process's write end of the pipe: its reader sees the end
        for thread in self._threads:
            # A child process the script left running may hold the pipe open: stop waiting after a
            # moment; the (daemon) thread goes on copying whatever that child still writes.
            thread.join(_DRAIN_TIMEOUT_S)
        for (fd, saved), thread in zip(self._saved.items(), self._threads):
            if not thread.is_alive():
                os.close(saved)
        time.sleep(_SETTLE_S)

    def _pump(self, read_fd: int, out_fd: int) -> None:
        pending = b""
        last_redraw = 0.0
        try:
            while True:
                chunk = os.read(read_fd, 65536)
                if not chunk:
                    break
                pieces = _LINE_ENDS.split(pending + chunk)
                pending = pieces.pop()  # the text after the last line end (maybe b"")
                for text, end in zip(pieces[0::2], pieces[1::2]):
                    if end == b"\r":
                        now = time.monotonic()
                        if not text.strip() or now - last_redraw < _REDRAW_INTERVAL_S:
                            continue
                        last_redraw = now
                    self._write(out_fd, text)
            if pending:
                self._write(out_fd, pending)
        finally:
            os.close(read_fd)

    def _write(self, out_fd: int, text: bytes) -> None:
        line = text + b"\n" if _RAY_MAGIC.match(text) else self._prefix + text + b"\n"
        try:
            os.write(out_fd, line)
        except OSError:
            return  # the descriptor is gone (the process is ending): nothing to copy to
        if self._on_line is not None:
            self._on_line()
