"""Stage-3 parameter shards on NVMe (`offload_param.device: nvme`): a swap file read and written
through `buffer_count` staging buffers of `buffer_size` elements.

[Note: NVMe parameter shards]
DeepSpeed's design (AsyncPartitionedParameterSwapper), with the same keys:
  - The first `max_in_cpu` elements of shards (in allocation order: the model's first parameters)
    stay in host memory as ordinary tensors; every later shard lives only in this rank's swap file
    (`SwapSlot`: an aligned range of it), its `entry.shard` a 0-element placeholder.
  - A gather that needs a swapped shard reads it (O_DIRECT, the aio thread pool of swap_io.py) into
    a free staging buffer, copies it out as the all-gather's input and frees the buffer at once, so
    shards in memory never exceed `buffer_count` x `buffer_size` elements (plus what is in flight
    in a collective, as without offload). A shard larger than `buffer_size` is refused when the
    engine is built, as DeepSpeed refuses it.
  - Prefetch reads ahead (`read_ahead`): while the hooks gather the next modules, the shards after
    them along the recorded order (stage3/trace.py) are already being read into the free buffers,
    one buffer always left for a read the trace did not foresee, so the gather finds them in memory.
  - Shards change only when the step publishes new values (and on load / GatheredParameters): each
    write drops what was read ahead (now stale), casts the values into a buffer and writes it back
    asynchronously; reads wait for pending writes first.
The file is scratch of this process, removed with the backend (`close`).
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from rayzero.checkpoint.types import LazyPiece
from rayzero.config.errors import RayZeroValueError
from rayzero.engine.offload.swap_io import AlignedBuffer, IOKnobs, SwapFile, align_up


@dataclass(eq=False)
class SwapSlot:
    """Where one swapped-out shard lives, and the staging buffer holding it while read ahead."""

    offset: int
    """Bytes into the swap file (page aligned)."""
    numel: int
    dtype: torch.dtype
    buffer: int | None = None
    """Index of the staging buffer a read-ahead filled (or is filling); None otherwise."""
    reading: Future | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class NvmeParamStore:
    """This rank's swapped parameter shards ([Note: NVMe parameter shards])."""

    def __init__(self, directory: str, knobs: IOKnobs, buffer_count: int, buffer_elements: int,
                 max_in_cpu: int) -> None:
        if buffer_count < 1 or buffer_elements < 1:
            raise RayZeroValueError(
                f"zero_optimization.offload_param.buffer_count = {buffer_count} and buffer_size = {buffer_elements}: "
                "NVMe parameter offload needs at least one staging buffer of at least one element; use "
                "DeepSpeed's defaults (buffer_count 5, buffer_size 1e8)")
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.buffer_count, self.buffer_elements, self.max_in_cpu = buffer_count, buffer_elements, max_in_cpu
        self._io = ThreadPoolExecutor(knobs.in_flight, thread_name_prefix="rayzero-param-io")
        # Whole-shard reads and writes, one per staging buffer at once: several small shards (biases)
        # are in flight together instead of queueing behind each other's latency.
        self._driver = ThreadPoolExecutor(buffer_count, thread_name_prefix="rayzero-param-swap")
        self.file = SwapFile(os.path.join(directory, f"params-{uuid.uuid4().hex[:8]}.swp"), self._io, knobs)
        self._buffers: list[AlignedBuffer] = []  # made on first use, sized for the shards' dtype
        self._free: list[int] = []
        self._ahead: list[SwapSlot] = []  # read ahead, oldest first
        self._writes: list[tuple[Future, int]] = []  # (pending write, its buffer)
        self._end = 0
        self.cached_elements = 0
        self.bytes = 0
        """Bytes of the shards that live in the swap file."""
        self.read_seconds = self.write_seconds = 0.0
        self._write_lock = threading.Lock()  # write_seconds is added to from the driver's threads
        self.buffers_peak = 0
        self._slots: list[SwapSlot] = []  # allocation order (the model's order)
        self._closed = False

    # ---- placement --------------------------------------------------------------------------
    def place(self, values: torch.Tensor, dtype: torch.dtype, name: str) -> tuple[torch.Tensor, SwapSlot | None]:
        """A shard holding `values` (cast to `dtype`): (a host tensor, None) within `max_in_cpu`,
        else (a 0-element placeholder, its slot in the swap file, being written)."""
        numel = values.numel()
        if self.cached_elements + numel <= self.max_in_cpu:
            self.cached_elements += numel
            return values.to("cpu", dtype, copy=True), None
        if numel > self.buffer_elements:
            raise RayZeroValueError(
                f"zero_optimization.offload_param.buffer_size = {self.buffer_elements} elements is smaller than the "
                f"shard of parameter {name} ({numel} elements on this rank): a staging buffer must hold the largest "
                f"shard, as in DeepSpeed. Set buffer_size to at least {numel}, or keep that parameter in memory with "
                "a larger offload_param.max_in_cpu")
        slot = SwapSlot(self._end, numel, dtype)
        self._end += align_up(slot.nbytes)
        self.file.reserve(self._end)
        self.bytes += slot.nbytes
        self._slots.append(slot)
        self.write(slot, values)
        return torch.empty(0, dtype=dtype), slot

    # ---- staging buffers --------------------------------------------------------------------
    def _acquire(self, dtype: torch.dtype) -> int:
        """A free staging buffer: wait for the oldest write, else give up the newest read-ahead."""
        if not self._buffers:
            self._buffers = [AlignedBuffer(self.buffer_elements * dtype.itemsize) for _ in range(self.buffer_count)]
            self._free = list(range(self.buffer_count))
        if not self._free and self._writes:
            future, index = self._writes.pop(0)
            future.result()
            self._free.append(index)
        if not self._free:
            self._forget(self._ahead.pop())
        index = self._free.pop()
        self.buffers_peak = max(self.buffers_peak, self.buffer_count - len(self._free))
        return index

    def _forget(self, slot: SwapSlot) -> None:
        if slot.reading is not None:
            slot.reading.result()
        self._free.append(slot.buffer)
        slot.buffer = slot.reading = None

    def _flush_writes(self) -> None:
        for future, index in self._writes:
            future.result()
            self._free.append(index)
        self._writes.clear()

    def _start_read(self, slot: SwapSlot) -> None:
        slot.buffer = self._acquire(slot.dtype)
        buffer = self._buffers[slot.buffer]
        slot.reading = self._driver.submit(self.file.read, buffer, slot.nbytes, slot.offset)

    # ---- reading ----------------------------------------------------------------------------
    def read_ahead(self, slots: list[SwapSlot]) -> None:
        """Start reading `slots` (in order) into free buffers, keeping one free for demand reads."""
        self._flush_writes()
        for slot in slots:
            if slot.buffer is not None:
                continue
            if (len(self._free) if self._buffers else self.buffer_count) <= 1:
                return
            self._start_read(slot)
            self._ahead.append(slot)

    def read_ahead_first(self) -> None:
        """Before a forward: start reading the first swapped shards (the model's first layers)."""
        self.read_ahead(self._slots[: self.buffer_count])

    def copy_out(self, slot: SwapSlot, device: torch.device) -> torch.Tensor:
        """The shard's values as a new tensor on `device`; its staging buffer is free again after."""
        self._flush_writes()
        if slot.buffer is None:
            self._start_read(slot)
        else:
            self._ahead.remove(slot)
        start = time.perf_counter()
        slot.reading.result()
        self.read_seconds += time.perf_counter() - start
        out = self._buffers[slot.buffer].view(0, slot.numel, slot.dtype).to(device, copy=True)
        self._free.append(slot.buffer)
        slot.buffer = slot.reading = None
        return out

    def drop_read_ahead(self) -> None:
        while self._ahead:
            self._forget(self._ahead.pop())

    # ---- writing ----------------------------------------------------------------------------
    def write(self, slot: SwapSlot, values: torch.Tensor) -> None:
        """The shard becomes `values` (cast; fewer elements: the rest, padding, is zero). Written
        back asynchronously; later reads wait for it."""
        self.drop_read_ahead()  # what was read ahead predates this write
        index = self._acquire(slot.dtype)
        view = self._buffers[index].view(0, slot.numel, slot.dtype)
        count = values.numel()
        view[:count].copy_(values.reshape(-1))
        view[count:].zero_()

        def write() -> None:
            start = time.perf_counter()
            self.file.write(self._buffers[index], slot.nbytes, slot.offset)
            with self._write_lock:
                self.write_seconds += time.perf_counter() - start
        self._writes.append((self._driver.submit(write), index))

    def lazy_piece(self, slot: SwapSlot, count: int, offset: int = 0) -> LazyPiece:
        """`count` elements from `offset`, read only when a checkpoint writer asks ([Note: streamed save])."""
        return _SwappedShard(self, slot, count, offset)

    def timings(self) -> dict[str, float]:
        """Seconds gathers waited for shard reads, and seconds of shard writes (summed over the
        writes in flight together), since the last call; pending writes finish first."""
        self._flush_writes()
        out = {"nvme_param_read": self.read_seconds, "nvme_param_write": self.write_seconds}
        self.read_seconds = self.write_seconds = 0.0
        return out

    @property
    def staging_bytes(self) -> int:
        return sum(buffer.nbytes for buffer in self._buffers)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for future, _ in self._writes:
            future.exception()  # finished before the file goes
        self._writes.clear()
        for slot in self._ahead:
            if slot.reading is not None:
                slot.reading.exception()
        self._ahead.clear()
        self._driver.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self.file.close(remove=True)
        for buffer in self._buffers:
            buffer.close()
        self._buffers, self._free = [], []


class _SwappedShard(LazyPiece):
    def __init__(self, store: NvmeParamStore, slot: SwapSlot, count: int, offset: int) -> None:
        super().__init__(count, slot.dtype)
        self._store, self._slot, self._offset = store, slot, offset

    def materialize(self) -> torch.Tensor:
        return self._store.copy_out(self._slot, torch.device("cpu"))[self._offset:self._offset + self.numel()]
