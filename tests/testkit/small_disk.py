"""A small mounted filesystem for tests of a full disk (the `small_disk` fixture in conftest.py
mounts it); importable from the spawned ranks of tests/dist too."""
from __future__ import annotations

from pathlib import Path

from bench.chaos_world import SmallDisk as _SmallDisk


class SmallDisk(_SmallDisk):
    """A mounted small filesystem (see the `small_disk` fixture, which mounts and unmounts it): the chaos
    soak's disk (bench/chaos_world.py), filled and released the same way."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(Path(path), Path(path).with_suffix(".ext4"))
        self.kind = kind
