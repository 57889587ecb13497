"""Python's cyclic garbage collector paused around building and reading manifests.

A manifest records every rank's shard and RNG state (about 20 kB per rank, ~90 MB at 4,096 ranks).
Building, serializing or parsing one makes millions of containers; each allocation burst sets off
collections that walk every object made so far, so the work grows faster than the manifest
(bench/scale.py: a parse N^1.2, the commit's CPU N^1.1). None of these objects forms a cycle, so
refcounting frees them as before; the pause only skips the walks. Used by the saver's commit
(saver.py) and the controller's registry ([Note: registry scans] in committed_checkpoints.py).
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (left as it was after)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
