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
from concurrent.futures import ThreadPoolExecutor

import torch

BLOCK = 4096  # O_DIRECT alignment for offsets, lengths and buffer addresses on common disks
STAGING_BYTES = 16 << 20  # per staging buffer; two are in flight
_READ_CHUNK = 8 << 20
_READ_THREADS = 4
_STREAM_CHUNK = 32 << 20


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
            buffer, length, recycle = item
            try:
                if self._error is None:
                    view = memoryview(buffer)[:length]
                    written = 0
                    while written < length:
                        written += os.write(self.fd, view[written:])
            except BaseException as error:  # noqa: BLE001 - re-raised by close() in the caller's thread
                self._error = error
            finally:
                if recycle:
                    self._free.put(buffer)

    def write(self, data: memoryview, address: int | None = None) -> None:
        """Append `data`. When `address` (of data's first byte) is block-aligned and the file
        position is too, the block-aligned bulk is written straight from `data`, no copy; the caller
        keeps `data` unchanged until close()."""
        if (self.direct and address is not None and address % BLOCK == 0 and self.size % BLOCK == 0
                and len(data) >= BLOCK):
            if self._filled:  # a whole number of blocks, since the file position is aligned
                self._full.put((self._current, self._filled, True))
                self._current, self._filled = self._free.get(), 0
            bulk = len(data) // BLOCK * BLOCK
            self._full.put((data[:bulk], bulk, False))
            self.size += bulk
            data = data[bulk:]
        position, total = 0, len(data)
        while position < total:
            count = min(STAGING_BYTES - self._filled, total - position)
            self._current[self._filled:self._filled + count] = data[position:position + count]
            self._filled += count
            position += count
            if self._filled == STAGING_BYTES:
                self._full.put((self._current, STAGING_BYTES, True))
                self._current, self._filled = self._free.get(), 0
        self.size += total

    def close(self) -> None:
        """Flush, fsync and close; raises the first write error."""
        try:
            if self._filled:
                padded = -(-self._filled // BLOCK) * BLOCK if self.direct else self._filled
                self._current[self._filled:padded] = bytes(padded - self._filled)
                self._full.put((self._current, padded, True))
            self._full.put(None)
            self._thread.join()
            if self._error is not None:
                raise self._error
            os.ftruncate(self.fd, self.size)  # drop the block padding
            if self.fsync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1  # closed: never close the number again (it may name another file by then)


    def abort(self) -> None:
        """Stop writing, close, and remove the file (after a failure: nothing partial is left)."""
        self._error = self._error or OSError("aborted")
        self._full.put(None)
        self._thread.join()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.remove(self.path)
        except OSError:
            pass


def read_file(path: str, on_data=None) -> torch.Tensor:
    """The whole file as a uint8 tensor, read with O_DIRECT into a page-aligned buffer.

    Several reads are in flight at once (a queue depth of `_READ_THREADS`): one sequential stream
    leaves virtual and NVMe disks idle between requests, and the page faults of the fresh buffer
    are taken on several threads. `on_data(memoryview)` then sees all bytes (the checksum: xxh3
    runs at ~24 GB/s, so one pass after the reads costs little).
    """
    size = os.path.getsize(path)
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    rounded = -(-size // BLOCK) * BLOCK
    buffer = mmap.mmap(-1, rounded)
    view = memoryview(buffer)
    fd, direct = _open_direct(path, os.O_RDONLY)

    def read_chunk(offset: int) -> int:
        want = min(_READ_CHUNK, (rounded if direct else size) - offset)
        done = 0
        while done < want:
            count = os.preadv(fd, [view[offset + done:offset + want]], offset + done)
            if count <= 0:
                break
            done += count
        return done

    try:
        with ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="rayzero-read") as pool:
            total = sum(min(got, size - offset) for offset, got in
                        zip(range(0, size, _READ_CHUNK), pool.map(read_chunk, range(0, size, _READ_CHUNK))))
    finally:
        os.close(fd)
    if total < size:
        raise OSError(f"{path}: read {total} of {size} bytes (file truncated while reading?)")
    if on_data is not None:
        on_data(view[:size])
    # the tensor keeps the mmap alive (torch.frombuffer holds a reference to the buffer)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=size)


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor at a page-aligned address, which DirectWriter writes without a copy."""
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes)  # anonymous maps are page-aligned; the tensor keeps the map alive
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype)


def stream_file(path: str, on_chunk) -> int:
    """Read `path` front to back through two reused page-aligned buffers (O_DIRECT where possible),
    calling `on_chunk(file_offset, uint8 tensor)` for each chunk in order while the next one is read.
    Memory stays bounded by the buffers, and no fresh pages are touched: on the machines we measured,
    faulting in fresh memory, not the disk, bounded a whole-file read. Returns the bytes read."""
    size = os.path.getsize(path)
    buffers = [mmap.mmap(-1, _STREAM_CHUNK) for _ in range(2)]
    tensors = [torch.frombuffer(buffer, dtype=torch.uint8) for buffer in buffers]
    fd, direct = _open_direct(path, os.O_RDONLY)

    def read_chunk(index: int, offset: int) -> int:
        want = min(_STREAM_CHUNK, -(-(size - offset) // BLOCK) * BLOCK if direct else size - offset)
        view, done = memoryview(buffers[index]), 0
        while done < want:
            count = os.preadv(fd, [view[done:want]], offset + done)
            if count <= 0:
                break
            done += count
        return min(done, size - offset)

    total = 0
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="rayzero-read") as pool:
            pending = pool.submit(read_chunk, 0, 0) if size else None
            for number, offset in enumerate(range(0, size, _STREAM_CHUNK)):
                got = pending.result()
                following = offset + _STREAM_CHUNK
                pending = pool.submit(read_chunk, (number + 1) % 2, following) if following < size else None
                if got < min(_STREAM_CHUNK, size - offset):
                    raise OSError(f"{path}: short read at byte {offset + got} of {size}")
                on_chunk(offset, tensors[number % 2][:got])
                total += got
    finally:
        os.close(fd)
    return total
