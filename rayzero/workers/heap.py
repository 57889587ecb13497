"""Free heap pages handed back to the system, for the processes that run as long as the run does.

[Note: the allocator's free pages]
The driver, the controller and the node relays pass every report of a run through their process:
the collect answers, the lists of reports, the pickled updates (hundreds of kB a second at a few
thousand reports a second), made and freed in several threads (the controller's, Ray's, gRPC's),
each with a glibc malloc arena of its own. Freed chunks stay in their arena for reuse, and where a longer-lived
allocation sits after them the arena cannot shrink: the free space grows with the run, and its
pages stay resident. bench/longrun.py measured it (malloc's free bytes over all arenas, beside the
bytes in use): the controller's free chunks grew ~1 MiB per 100,000 steps at 1,000 steps a second
while nothing was kept. `malloc_trim(0)` gives every whole free page of every arena back to the
system (madvise; the chunks stay free for reuse): ~3 ms when there is something to give back,
0.1 ms when not, so the controller and each relay call it at most every `TRIM_INTERVAL_S`, and the
driver's metrics writer after each part it writes. Elsewhere than glibc (musl, macOS) there is no such call and nothing is done.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

TRIM_INTERVAL_S = 10.0
"""How often the controller and a relay hand their free heap pages back ([Note: the allocator's free pages])."""


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Give the C heap's whole free pages back to the system ([Note: the allocator's free pages]);
    True when some were."""
    trim = _malloc_trim()
    return bool(trim is not None and trim(0))
