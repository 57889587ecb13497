"""File I/O at disk bandwidth: O_DIRECT through page-aligned staging buffers.

[Note: direct I/O]
Buffered writes copy every byte into the page cache and then write it back; on the machines we
measured (see bench/checkpoint.py) that path reached ~0.2-0.45 of what `dd oflag=direct` does on
the same disk, because the page-cache copy and the page allocations it needs compete for memory
bandwidth. With O_DIRECT the disk DMAs straight from a user buffer. Our files are a safetensors
header followed by tensors at unaligned offsets, so bytes are first packed into page-aligned staging
buffers (one reused memcpy, no page faults) and a second thread writes each full buffer while the
next is packed. The last buffer is padded to the block size and the file truncated to its real
length. Filesystems without O_DIRECT (tmpfs, some FUSE mounts) fall back to buffered I/O.
Reads go the same way: straight into a page-aligned buffer that becomes the file's tensor.
"""
from __future__ import annotations

import mmap
import os
import queue
import threading

import torch

_BLOCK = 4096  # O_DIRECT alignment for offsets, lengths and buffer addresses on common disks
STAGING_BYTES = 16 << 20  # per staging buffer; two are in flight
_READ_CHUNK = 64 << 20


def _open_direct(path: str, flags: int) -> tuple[int, bool]:
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o644), True
        except OSError:
            pass
    return os.open(path, flags, 0o644), False


class DirectWriter:
    """Append-only writer: `write(bytes-like)` packs into staging buffers, a thread writes them out."""

    def __init__(self, path: str, fsync: bool = True) -> None:
        self.path, self.fsync = path, fsync
        self.fd, self.direct = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self.size = 0
        self._free: queue.Queue = queue.Queue()
        for _ in range(2):
            self._free.put(mmap.mmap(-1, STAGING_BYTES))
        self._full: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._current = self._free.get()
        self._filled = 0
        self._thread = threading.Thread(target=self._drain, name="rayzero-direct-write", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            item = self._full.get()
            if item is None:
                return
            buffer, length = item
            try:
                if self._error is None:
                    view = memoryview(buffer)[:length]
                    written = 0
                    while written < length:
                        written += os.write(self.fd, view[written:])
            except BaseException as error:  # noqa: BLE001 - re-raised by close() in the caller's thread
                self._error = error
            finally:
                self._free.put(buffer)

    def write(self, data: memoryview) -> None:
        position, total = 0, len(data)
        while position < total:
            count = min(STAGING_BYTES - self._filled, total - position)
            self._current[self._filled:self._filled + count] = data[position:position + count]
            self._filled += count
            position += count
            if self._filled == STAGING_BYTES:
                self._full.put((self._current, STAGING_BYTES))
                self._current, self._filled = self._free.get(), 0
        self.size += total

    def close(self) -> None:
        """Flush, fsync and close; raises the first write error."""
        try:
            if self._filled:
                padded = -(-self._filled // _BLOCK) * _BLOCK if self.direct else self._filled
                self._current[self._filled:padded] = bytes(padded - self._filled)
                self._full.put((self._current, padded))
            self._full.put(None)
            self._thread.join()
            if self._error is not None:
                raise self._error
            os.ftruncate(self.fd, self.size)  # drop the block padding
            if self.fsync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)


def read_file(path: str, on_chunk=None) -> torch.Tensor:
    """The whole file as a uint8 tensor, read with O_DIRECT into a page-aligned buffer.

    `on_chunk(memoryview)` sees the bytes in order (the checksum), while they are still in cache.
    """
    size = os.path.getsize(path)
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    rounded = -(-size // _BLOCK) * _BLOCK
    buffer = mmap.mmap(-1, rounded, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    view = memoryview(buffer)
    fd, direct = _open_direct(path, os.O_RDONLY)
    try:
        position = 0
        while position < size:
            want = min(_READ_CHUNK, rounded - position) if direct else min(_READ_CHUNK, size - position)
            count = os.readv(fd, [view[position:position + want]])
            if count <= 0:
                break
            if on_chunk is not None:
                on_chunk(view[position:min(position + count, size)])
            position += count
    finally:
        os.close(fd)
    if position < size:
        raise OSError(f"{path}: read {position} of {size} bytes (file truncated while reading?)")
    # the tensor keeps the mmap alive (torch.frombuffer holds a reference to the buffer)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=size)
