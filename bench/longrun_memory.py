"""What a process's memory is made of, for bench/longrun.py: sampled in the driver, and inside the
controller and the relay actors through `__ray_call__`, so a growth can be named.

`probe()` splits a process's memory the ways it can grow:
- `rss`: what the kernel counts (the figure the targets are about), and its parts `rss_anon`,
  `rss_file` (library code paged in as first run), `rss_shmem` (Ray's object store: the pages of it
  this process touched, shared with the store, not its own);
- `heap_in_use` / `heap_free`: glibc malloc's chunks in use and free over every arena (`malloc_info`;
  `mallinfo2` sees the main arena only, and a thread's allocations go to its own): the C side
  (Ray's core worker, gRPC, pyarrow's buffers outside its pool, Python objects over 512 bytes);
  `heap_free` growing while `heap_in_use` does not is fragmentation, not retention;
- `python_blocks`: Python's small-object allocator's live blocks (`sys.getallocatedblocks`): objects
  kept alive by Python code; `pymalloc_arenas`: the bytes of its arenas (blocks flat while arenas
  grow is that allocator's fragmentation);
- `arrow_bytes`: pyarrow's pool in use (its mimalloc keeps freed pages for reuse: RSS, not in use).

No module state and no classes here: the functions travel to the actors by value.
"""
from __future__ import annotations

import os
import statistics
from typing import Any


def _heap() -> dict[str, int]:
    """glibc malloc over all arenas: bytes taken from the system (arenas + mmapped chunks) and free in them."""
    import ctypes
    import re
    import tempfile

    libc = ctypes.CDLL(None)
    libc.fdopen.restype = ctypes.c_void_p
    libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    with tempfile.TemporaryFile() as buffer:
        stream = libc.fdopen(os.dup(buffer.fileno()), b"w")
        if not stream:
            return {}
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        buffer.seek(0)
        text = buffer.read().decode()
    totals = text[text.rfind("</heap>"):]  # the totals over every arena follow the last heap
    free = sum(int(size) for size in re.findall(r'<total type="(?:fast|rest)" count="\d+" size="(\d+)"/>', totals))
    mmapped = re.search(r'<total type="mmap" count="\d+" size="(\d+)"/>', totals)
    system = re.search(r'<system type="current" size="(\d+)"/>', totals)
    if system is None:
        return {}
    arenas = int(system.group(1))
    mapped = int(mmapped.group(1)) if mmapped else 0
    return {"heap_in_use": arenas - free + mapped, "heap_free": free, "heap_system": arenas + mapped}


def _pymalloc() -> dict[str, int]:
    """Python's small-object allocator: bytes in its arenas (blocks live or not; an arena goes back to
    the system only when all its blocks are free), from `sys._debugmallocstats`, which writes to fd 2
    (redirected for the call: a line another thread logs meanwhile lands in the figures' file)."""
    import re
    import sys
    import tempfile

    with tempfile.TemporaryFile() as buffer:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(buffer.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        buffer.seek(0)
        text = buffer.read().decode(errors="replace")
    arenas = re.search(r"(\d+) arenas \* (\d+) bytes/arena", text)
    return {"pymalloc_arenas": int(arenas.group(1)) * int(arenas.group(2))} if arenas else {}


def _status() -> dict[str, int]:
    """The kernel's split of the resident pages: anonymous, file-backed (code and data of the loaded
    libraries, paged in as first used), shared memory (Ray's object store pages a process touched)."""
    out = {}
    with open("/proc/self/status") as source:
        for line in source:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssFile", "RssShmem"):
                out["rss_" + name[3:].lower()] = int(value.split()[0]) * 1024
    return out


def probe() -> dict[str, Any]:
    """This process's memory now (see the module docstring)."""
    import sys

    with open("/proc/self/statm") as source:
        out: dict[str, Any] = {"pid": os.getpid(),
                               "rss": int(source.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"),
                               "python_blocks": sys.getallocatedblocks()}
    for part in (_status, _heap, _pymalloc):
        try:
            out.update(part())
        except (OSError, AttributeError, ValueError):  # not Linux, not glibc: the other figures still say something
            pass
    if "pyarrow" in sys.modules:
        out["arrow_bytes"] = sys.modules["pyarrow"].total_allocated_bytes()
    return out


def relay_side(actor: Any) -> dict[str, Any]:
    """Run in a relay actor (`__ray_call__`)."""
    return probe()


def controller_side(actor: Any) -> dict[str, Any]:
    """Run in the controller actor (`__ray_call__`): its own figures and each relay actor's."""
    import ray

    group = getattr(actor._controller, "_group", None)
    relays = list(getattr(group, "_relay_actors", []) or [])
    found = []
    for relay in relays:
        try:
            found.append(ray.get(relay.__ray_call__.remote(relay_side), timeout=10))
        except Exception as error:  # noqa: BLE001 - a relay of an attempt that ended: no figures this time
            found.append({"error": f"{type(error).__name__}: {error}"[:200]})
    return {"controller": probe(), "relays": found}


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys on xs (None with fewer than 3 points)."""
    if len(xs) < 3:
        return None
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    denominator = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / denominator if denominator else None


FIGURES = ("rss", "rss_anon", "rss_file", "rss_shmem", "heap_in_use", "heap_free", "pymalloc_arenas",
           "python_blocks", "arrow_bytes")


def growth(points: list[tuple[float, float, dict[str, Any]]], from_step: float) -> dict[str, Any]:
    """Per figure, the slope against steps (per 100,000) and against wall time (per hour) over the
    points at or after `from_step` (the warm-up left out), and the first and last values there.
    `points`: (step, seconds, probe), seconds all 0 where there is no wall time. Bytes in MiB;
    python_blocks in blocks."""
    steady = [point for point in points if point[0] >= from_step]
    out: dict[str, Any] = {"points": len(steady), "from_step": from_step}
    for figure in FIGURES:
        rows = [(step, seconds, probed[figure]) for step, seconds, probed in steady if figure in probed]
        if len(rows) < 3:
            continue
        scale = 1.0 if figure == "python_blocks" else 1.0 / 2**20
        per_step = slope([row[0] for row in rows], [row[2] * scale for row in rows])
        per_second = slope([row[1] for row in rows], [row[2] * scale for row in rows])
        out[figure] = {"first": rows[0][2] * scale, "last": rows[-1][2] * scale,
                       "per_100k_steps": None if per_step is None else per_step * 1e5}
        if per_second is not None:  # None too where the points carry no wall time (a simulation)
            out[figure]["per_hour"] = per_second * 3600
    return out
