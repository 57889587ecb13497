"""Stage-3 parameter shards on NVMe (`offload_param.device: nvme`): memory-mapped swap files.

[Note: NVMe parameter shards]
Parameter shards are read once per gather (forward, backward) and written once per step (publish),
in the module order the hooks already prefetch along; they are small next to the optimizer state.
They live in swap files under `offload_param.nvme_path`, mapped into the process (`torch.from_file`,
shared): a shard tensor *is* its file's bytes, so the kernel pages a shard in when the all-gather
reads it, writes it back after the step updates it, and may drop it again under memory pressure —
the page cache plays DeepSpeed's `max_in_cpu` cache, readahead its prefetch. What this does not do
is bound that cache: `buffer_count` / `buffer_size` / `max_in_cpu` are not used (a warning says so).
Shards are carved from arenas of `ARENA_BYTES` (fewer files and mappings than one per parameter).
The files are scratch of this process, removed with the optimizer's swap directory.
"""
from __future__ import annotations

import os
import uuid

import torch

ARENA_BYTES = 256 << 20
_ALIGN = 4096


class ParamArena:
    """Hands out 1-D tensors backed by mapped swap files in `directory`."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._current: torch.Tensor | None = None  # uint8 view of the current arena
        self._used = 0
        self.files: list[str] = []
        self.bytes = 0

    def _new_arena(self, nbytes: int) -> None:
        size = max(ARENA_BYTES, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)
        path = os.path.join(self.directory, f"params-{len(self.files):04d}-{uuid.uuid4().hex[:6]}.bin")
        with open(path, "wb") as handle:
            handle.truncate(size)  # sparse until written
        self._current = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self._used = 0
        self.files.append(path)

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self._current is None or self._used + nbytes > self._current.numel():
            self._new_arena(nbytes)
        start = self._used
        self._used = (start + nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.bytes += nbytes
        out = self._current[start:start + nbytes].view(dtype)
        out.zero_()
        return out
