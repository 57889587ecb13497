"""Stage-3 parameter shards on NVMe (`offload_param.device: nvme`): memory-mapped swap files.

[Note: NVMe parameter shards]
Parameter shards are read once per gather (forward, backward) and written once per step (publish),
in the module order the hooks already prefetch along; they are small next to the optimizer state.
They live in swap files under `offload_param.nvme_path`, mapped into the process (MAP_SHARED): a
shard tensor *is* its file's bytes, so the kernel pages a shard in when the all-gather reads it and
writes it back after the step updates it. `max_in_cpu` bounds what stays in memory between steps:
after each step's publish, the shards past the first `max_in_cpu` elements (in allocation order:
the model's first parameters stay) are paged out (`madvise(MADV_PAGEOUT)`: written back and
dropped; MADV_DONTNEED where the kernel lacks it), so their bytes really are on the disk until the
next forward: its first step asks the kernel to read them all back in the background
(`MADV_WILLNEED`, `read_ahead`), so the gathers along the module order mostly find them in memory.
What this does not do is bound memory *during* forward and backward
(a shard read for a gather stays until the step) nor stage through `buffer_count` × `buffer_size`
O_DIRECT buffers (a warning says so). Shards are carved from arenas of `ARENA_BYTES`, page aligned
(fewer files and mappings than one per parameter). The files are scratch of this process, removed
with the optimizer's swap directory.
"""
from __future__ import annotations

import mmap
import os
import uuid

import torch

ARENA_BYTES = 256 << 20
_ALIGN = mmap.PAGESIZE
_MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21)  # Linux >= 5.4; Python exposes it from 3.12 only


class ParamArena:
    """Hands out 1-D tensors backed by mapped swap files in `directory`."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._current: torch.Tensor | None = None  # uint8 view of the current arena
        self._maps: list[mmap.mmap] = []
        self._pieces: list[tuple[mmap.mmap, int, int, int]] = []  # (map, start, bytes, elements), in order
        self._used = 0
        self._paged_out = False
        self.files: list[str] = []
        self.bytes = 0

    def _new_arena(self, nbytes: int) -> None:
        size = max(ARENA_BYTES, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)
        path = os.path.join(self.directory, f"params-{len(self.files):04d}-{uuid.uuid4().hex[:6]}.bin")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)  # sparse until written
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the file
        self._maps.append(mapped)
        self._current = torch.frombuffer(mapped, dtype=torch.uint8)
        self._used = 0
        self.files.append(path)

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self._current is None or self._used + nbytes > self._current.numel():
            self._new_arena(nbytes)
        start = self._used
        self._used = (start + nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.bytes += nbytes
        self._pieces.append((self._maps[-1], start, nbytes, numel))
        out = self._current[start:start + nbytes].view(dtype)
        out.zero_()
        return out

    def read_ahead(self) -> None:
        """Ask the kernel to read every paged-out shard back in the background (MADV_WILLNEED),
        in allocation order, while the forward pass works through the first layers."""
        if not self._paged_out:
            return
        for mapped, start, nbytes, _ in self._pieces:
            mapped.madvise(mmap.MADV_WILLNEED, start, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)
        self._paged_out = False

    def page_out(self, keep_elements: int) -> int:
        """Keep the first `keep_elements` shard elements in memory, page the rest out to their
        files ([Note: NVMe parameter shards]); returns the bytes advised out."""
        kept = advised = 0
        for mapped, start, nbytes, numel in self._pieces:
            if kept + numel <= keep_elements:
                kept += numel
                continue
            length = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
            try:
                mapped.madvise(_MADV_PAGEOUT, start, length)
            except OSError:  # a kernel without MADV_PAGEOUT: drop the mapping's pages (kept in the cache)
                mapped.flush(start, length)
                mapped.madvise(mmap.MADV_DONTNEED, start, length)
            advised += nbytes
        self._paged_out = self._paged_out or advised > 0
        return advised
