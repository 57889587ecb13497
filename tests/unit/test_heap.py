"""[Note: the allocator's free pages] (rayzero/workers/heap.py): the driver, the controller and the
relays hand the free pages of their malloc arenas back to the system now and then."""
from __future__ import annotations

import platform
import threading

import pytest

from rayzero.workers.heap import release_free_heap

pytestmark = pytest.mark.unit


def _rss() -> int:
    with open("/proc/self/statm") as source:
        return int(source.read().split()[1]) * 4096


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_free_chunks_between_live_ones_are_given_back():
    kept = []

    def churn() -> None:  # a thread's arena: 40 MB of 2 kB chunks, freed but for every 64th
        chunks = [bytearray(2000) for _ in range(20_000)]
        kept.extend(chunks[::64])
        del chunks

    thread = threading.Thread(target=churn)
    thread.start()
    thread.join()
    before = _rss()
    assert release_free_heap()
    # the freed chunks' pages stayed resident: the arena could not shrink past the kept ones
    assert before - _rss() > 16 << 20, (before, _rss())
    assert len(kept) == 313
