"""A small mounted filesystem for tests of a full disk (the `small_disk` fixture in conftest.py
mounts it); importable from the spawned ranks of tests/dist too."""
from __future__ import annotations

import os
from pathlib import Path


class SmallDisk:
    """A mounted small filesystem (see the `small_disk` fixture)."""

    def __init__(self, path: Path, kind: str) -> None:
        self.path, self.kind = Path(path), kind
        self._filler = self.path / "filler.bin"

    def free_bytes(self) -> int:
        stats = os.statvfs(self.path)
        return stats.f_bavail * stats.f_frsize

    def fill(self, leave_bytes: int) -> None:
        """Take all but about `leave_bytes` of the free space (a user's big file, say)."""
        with open(self._filler, "ab") as out:
            while self.free_bytes() > leave_bytes:
                try:
                    out.write(b"\0" * max(4096, min(1 << 20, self.free_bytes() - leave_bytes)))
                    out.flush()
                    os.fsync(out.fileno())
                except OSError:
                    break

    def release(self) -> None:
        """Give the filler's space back."""
        self._filler.unlink(missing_ok=True)

