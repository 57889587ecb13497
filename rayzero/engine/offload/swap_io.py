"""Swap files for NVMe offload: the scratch directory of this process under `nvme_path`, page-aligned
host buffers and a thread pool of positional reads and writes on files opened with O_DIRECT.

[Note: swap I/O layer]
Choice by measurement (bench/offload.py, `swap` section): on this kind of machine a pool of
`os.preadv` / `os.pwritev` calls on an O_DIRECT descriptor, `block_size` bytes each, with
`queue_depth` of them in flight per I/O thread, reaches the `dd iflag/oflag=direct` figure of the
same filesystem, so no native aio library is needed (libaio needs a compiled extension; io_uring is
disabled in many containers). The `aio` section maps onto it as DeepSpeed's async_io uses it:
`block_size` bytes per request, `queue_depth` requests in flight per thread, `intra_op_parallelism`
(or its legacy name `thread_count`) threads — so threads × queue_depth requests in flight —
and `single_submit` — or `overlap_events: false`, which in DeepSpeed waits for each submission to
complete before the next — keeps one request in flight per thread. Buffers are anonymous
mmaps (page aligned, as O_DIRECT needs) wrapped as tensors, so reads land where the optimizer
computes: no bounce copy. Where O_DIRECT is refused (tmpfs, some FUSE mounts) the files are opened
buffered and `layer` says so.
"""
from __future__ import annotations

import mmap
import os
import shutil
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from rayzero.config.errors import RayZeroValueError

ALIGN = 4096


def _remove_stale(root: str) -> None:
    """Swap directories of processes of this host that no longer run (a killed run's scratch)."""
    prefix = socket.gethostname() + "-"
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if not name.startswith(prefix):
            continue
        try:
            pid = int(name[len(prefix):].split("-")[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except PermissionError:
            pass


def scratch_directory(nvme_path: str | None, key: str, suffix: str) -> str:
    """A fresh directory of this process under `<nvme_path>/rayzero-swap/` (checked, created; dead
    processes' directories removed first)."""
    root = os.path.join(_checked_directory(nvme_path, key), "rayzero-swap")
    os.makedirs(root, exist_ok=True)
    _remove_stale(root)
    directory = os.path.join(root, f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}-{suffix}")
    os.makedirs(directory)
    return directory


def _checked_directory(nvme_path: str | None, key: str) -> str:
    if not nvme_path:
        raise RayZeroValueError(f"{key} is missing: NVMe offload needs a directory on a fast local disk, e.g. "
                                f"\"nvme_path\": \"/local_nvme\" (or set device to \"cpu\")")
    if not os.path.isdir(nvme_path):
        # Not created: a typo (/local_nvmee) would put the swap files on another disk, often the root
        # filesystem. DeepSpeed 0.19.8 creates it (swap_tensor: os.makedirs); rayzero asks for it.
        raise RayZeroValueError(
            f"{key}={nvme_path!r} does not exist on node {socket.gethostname()}: rayzero does not create it, "
            "so a mistyped path cannot put swap files on another disk. Create it on every node (the fast "
            f"local disk's mount point, e.g. `mkdir -p {nvme_path}`), or fix the path")
    if not os.access(nvme_path, os.W_OK | os.X_OK):
        raise RayZeroValueError(f"{key}={nvme_path!r} is not writable by this process: point it at a writable "
                                "directory on a local disk")
    return nvme_path


def align_up(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class AlignedBuffer:
    """Page-aligned host memory of a fixed size, viewable as tensors of any dtype."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = align_up(max(nbytes, 1))
        self._map = mmap.mmap(-1, self.nbytes)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        size = numel * dtype.itemsize
        return self._bytes[offset:offset + size].view(dtype)

    def memoryview(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self._map)[offset:offset + nbytes]

    def close(self) -> None:
        self._bytes = None
        try:
            self._map.close()
        except BufferError:  # a tensor view is still alive; the map goes with it
            pass


@dataclass(frozen=True)
class IOKnobs:
    """The `aio` section as this layer uses it."""

    block_size: int = 1 << 20
    queue_depth: int = 8
    threads: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    @classmethod
    def from_config(cls, aio) -> IOKnobs:
        if aio is None:
            return cls()
        return cls(block_size=int(aio.block_size), queue_depth=int(aio.queue_depth),
                   threads=max(1, int(aio.intra_op_parallelism)), single_submit=bool(aio.single_submit),
                   overlap_events=bool(aio.overlap_events))

    @property
    def request_bytes(self) -> int:
        return align_up(self.block_size)

    @property
    def in_flight(self) -> int:
        """Requests in flight at once: the I/O pool's size."""
        return self.threads * (1 if self.single_submit or not self.overlap_events else self.queue_depth)


class SwapFile:
    """One swap file read and written whole, in aligned requests spread over a thread pool."""

    def __init__(self, path: str, pool: ThreadPoolExecutor, knobs: IOKnobs) -> None:
        self.path, self.pool, self.knobs = path, pool, knobs
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        self.direct = False
        direct = getattr(os, "O_DIRECT", 0)
        if direct:
            try:
                self.fd = os.open(path, flags | direct, 0o600)
                self.direct = True
            except OSError:
                self.fd = os.open(path, flags, 0o600)
        else:
            self.fd = os.open(path, flags, 0o600)

    def _requests(self, nbytes: int) -> list[tuple[int, int]]:
        span = self.knobs.request_bytes
        return [(offset, min(span, nbytes - offset)) for offset in range(0, nbytes, span)]

    def write(self, buffer: AlignedBuffer, nbytes: int, file_offset: int = 0) -> None:
        """Write the first `nbytes` (aligned up) of `buffer` at `file_offset` (aligned)."""
        self._transfer(os.pwritev, buffer, nbytes, file_offset)

    def read(self, buffer: AlignedBuffer, nbytes: int, file_offset: int = 0) -> None:
        """Fill the first `nbytes` (aligned up) of `buffer` from `file_offset` (aligned)."""
        self._transfer(os.preadv, buffer, nbytes, file_offset)

    def _transfer(self, call, buffer: AlignedBuffer, nbytes: int, file_offset: int) -> None:
        """`call` (os.preadv / os.pwritev) over the aligned range in parallel requests."""
        assert file_offset % ALIGN == 0, "O_DIRECT needs aligned file offsets"

        def one(offset: int, size: int) -> None:
            view = buffer.memoryview(offset, size)
            done = 0
            while done < size:
                moved = call(self.fd, [view[done:]], file_offset + offset + done)
                if moved == 0:
                    raise OSError(f"swap file {self.path} is shorter than expected ({file_offset + offset + done} < "
                                  f"{file_offset + offset + size} bytes): it was truncated or replaced while training")
                done += moved
        for future in [self.pool.submit(one, o, s) for o, s in self._requests(align_up(nbytes))]:
            future.result()

    def reserve(self, nbytes: int) -> None:
        """Make the file `nbytes` long (sparse: reads of unwritten ranges return zeros)."""
        if os.fstat(self.fd).st_size < nbytes:
            os.ftruncate(self.fd, nbytes)

    def close(self, remove: bool = True) -> None:
        os.close(self.fd)
        if remove:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def io_layer_name(direct: bool) -> str:
    return "threadpool-pread/pwrite+O_DIRECT" if direct else "threadpool-pread/pwrite (buffered: no O_DIRECT)"
