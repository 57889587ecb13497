"""NVMe optimizer offload (ZeRO-Infinity): per-element optimizer state in swap files under
`offload_optimizer.nvme_path`, brought into page-aligned host buffers one tile at a time for the
optimizer step.

[Note: NVMe tiles]
A tile is a range of at most `sub_group_size` elements of one tensor the optimizer steps (a bucket's
master piece at stages 1-2, a stage-3 sub-group); tiles never span two tensors. Between steps each
master's per-element state entries (`exp_avg`, `exp_avg_sq`, `momentum_buffer`, ...) are shape-only
`meta` tensors and the bytes are in the tiles' swap files; scalar state (`step`) stays in memory.
A tile is stepped through a *proxy*: a view of the master's range whose `.grad` is the same range of
the master gradient and whose state entries are views of a page-aligned buffer the tile's file was
read into, so torch's own (fused) kernel updates the master in place; the proxy's `step` is a copy,
written back to the master's state once all its tiles stepped. A step walks the tiles: read tile i+1
(`pipeline_read`), step tile i, write tile i-1 (`pipeline_write`), with at most three tile buffers —
host memory holds O(sub_group_size) of optimizer state, never the whole. Without the pipeline flags
the phases run one after another with one buffer. A tile's first step starts from zeros bound in its
buffer when that is bitwise torch's own first step (Adam, SGD without
dampening: `optim_state.zero_state_template` checks on a probe); otherwise torch creates the
tile-sized state, which is then written out, so first-step semantics are always torch's own.

Swap files are scratch owned by this process: `<nvme_path>/rayzero-swap/<host>-<pid>-<id>-rank<r>/`,
created fresh (never read before this process wrote them, so a restart cannot mistake an old file
for state), removed by `close()` and at exit; directories of processes that no longer exist on this
host are removed at start. Checkpoints hold the state itself ([Note: flat-range partitioning]):
`resident()` brings it into memory around a load.

[Note: streamed save]
Saving must not hold the whole optimizer state in RAM (it is on NVMe because it does not fit). So
each optimizer-state piece of a checkpoint is a `LazyPiece` (`checkpoint_piece`): the shard file
writer materializes it from the tiles overlapping its range, copies it into its staging buffers and
drops it, one piece at a time; the save is synchronous for such pieces (a background snapshot would
be the whole state in memory). Peak extra memory: the largest piece plus one tile buffer.
"""
from __future__ import annotations

import contextlib
import os
import queue
import shutil
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from rayzero.checkpoint.types import LazyPiece
from rayzero.config.errors import RayZeroValueError
from rayzero.engine.offload.host import HostOffload, cpu_threads
from rayzero.engine.offload.swap_io import (
    AlignedBuffer,
    IOKnobs,
    SwapFile,
    align_up,
    io_layer_name,
    scratch_directory,
)
from rayzero.engine.optim_state import zero_state_template

_TILE_ALIGN = 64
"""Elements: a multiple of every CPU vector width (AVX-512: 16 fp32) and of 4 KiB / 64."""


@dataclass(eq=False)
class _Tile:
    master: torch.Tensor
    start: int
    end: int
    file: SwapFile
    layout: list[tuple[str, int, torch.dtype]] = field(default_factory=list)
    """(state key, byte offset in the file, dtype) of every per-element state entry."""
    nbytes: int = 0

    @property
    def numel(self) -> int:
        return self.end - self.start

    def plan(self, entries: list[tuple[str, torch.dtype]]) -> None:
        """Lay out per-element state entries (key, dtype) in the file, each page aligned."""
        offset = 0
        self.layout = []
        for key, dtype in sorted(entries, key=lambda entry: entry[0]):
            self.layout.append((key, offset, dtype))
            offset += align_up(self.numel * dtype.itemsize)
        self.nbytes = offset

    def view(self, slot: AlignedBuffer, offset: int, dtype: torch.dtype) -> torch.Tensor:
        return slot.view(offset, self.numel, dtype)


def _elementwise(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def _owner_groups(optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    """id(parameter) -> the param group holding it."""
    return {id(p): group for group in optimizer.param_groups for p in group["params"]}


def _step_proxy(optimizer: torch.optim.Optimizer, tile: _Tile, state: dict, owner: dict) -> dict:
    """optimizer.step() on just `tile`'s range through a proxy ([Note: NVMe tiles]); returns the
    proxy's state (`state` as given, or what torch created when it was empty). `owner` is the
    param group holding the tile's master."""
    proxy = tile.master.detach()[tile.start:tile.end]
    proxy.grad = tile.master.grad[tile.start:tile.end]
    saved_groups, saved_params = optimizer.param_groups, owner["params"]
    optimizer.state[proxy] = state
    try:
        owner["params"] = [proxy]
        optimizer.param_groups = [owner]
        optimizer.step()
    finally:
        owner["params"] = saved_params
        optimizer.param_groups = saved_groups
        state = optimizer.state.pop(proxy)
    return state


class NvmeOffload(HostOffload):
    """`offload_optimizer.device: nvme` ([Note: offload placement], [Note: NVMe tiles])."""

    name = "nvme"

    def __init__(self, cfg: Any, compute_device: torch.device | str, rank: int = 0) -> None:
        super().__init__(cfg, compute_device)
        self.optimizer_home = "nvme"
        options = cfg.zero_optimization.offload_optimizer
        key = "zero_optimization.offload_optimizer.nvme_path"
        self.directory = scratch_directory(options.nvme_path, key, f"rank{rank}")
        self._key = key
        self.knobs = IOKnobs.from_config(cfg.aio)
        self.pipeline_read = bool(options.pipeline_read)
        self.pipeline_write = bool(options.pipeline_write)
        self._io = ThreadPoolExecutor(self.knobs.in_flight, thread_name_prefix="rayzero-swap-io")
        self._driver = ThreadPoolExecutor(1, thread_name_prefix="rayzero-swap")
        self._tiles: dict[int, list[_Tile]] = {}
        self._nvme_path = options.nvme_path
        # Tiles start at multiples of _TILE_ALIGN elements so the fused kernel's vector lanes fall on
        # the same elements as in one whole-tensor call: the result is bitwise the non-tiled one.
        sub_group = int(cfg.zero_optimization.sub_group_size)
        self.tile_elements = max(sub_group // _TILE_ALIGN, 1) * _TILE_ALIGN if sub_group > 0 else 0
        self._slots: list[AlignedBuffer] = []
        self._free: queue.Queue = queue.Queue()
        self._closed = False
        probe = SwapFile(os.path.join(self.directory, "probe"), self._io, self.knobs)
        self.direct = probe.direct
        probe.close()
        if not self.direct:
            warnings.warn(f"{key}={options.nvme_path!r}: the filesystem refuses O_DIRECT (tmpfs or a FUSE mount?); "
                          "swap files use buffered I/O through the page cache, which holds the state in memory "
                          "again. Point nvme_path at a local disk", stacklevel=3)
        self._own_scratch()

    @property
    def io_layer(self) -> str:
        return io_layer_name(self.direct)

    # ---- tiles ---------------------------------------------------------------------------------
    def _tiles_of(self, master: torch.Tensor) -> list[_Tile]:
        tiles = self._tiles.get(id(master))
        if tiles is None:
            numel = master.numel()
            size = self.tile_elements or numel
            tiles = []
            for start in range(0, numel, size):
                path = os.path.join(self.directory, f"master{len(self._tiles):04d}-{start:012d}.swp")
                tiles.append(_Tile(master, start, min(start + size, numel), SwapFile(path, self._io, self.knobs)))
            self._tiles[id(master)] = tiles
        return tiles

    @property
    def bytes_on_disk(self) -> int:
        return sum(tile.nbytes for tiles in self._tiles.values() for tile in tiles)

    def _acquire(self, nbytes: int) -> AlignedBuffer:
        count = 1 + self.pipeline_read + self.pipeline_write
        while len(self._slots) < count:
            self._slots.append(AlignedBuffer(nbytes))
            self._free.put(self._slots[-1])
        slot = self._free.get()
        if slot.nbytes < nbytes:  # tiles differ in size: grow this buffer once
            self._slots.remove(slot)
            slot.close()
            slot = AlignedBuffer(nbytes)
            self._slots.append(slot)
        return slot

    def _write(self, tile: _Tile, slot: AlignedBuffer) -> float:
        start = time.perf_counter()
        try:
            tile.file.write(slot, tile.nbytes)
        except OSError as error:
            raise RayZeroValueError(
                f"{self._key}: writing optimizer state to {tile.file.path} failed ({error.strerror or error}); "
                f"{shutil.disk_usage(self.directory).free} bytes are free there. Free space or point nvme_path "
                "at a larger disk") from error
        finally:
            self._free.put(slot)
        return time.perf_counter() - start

    def _read(self, tile: _Tile) -> tuple[AlignedBuffer, float]:
        slot = self._acquire(tile.nbytes)
        start = time.perf_counter()
        tile.file.read(slot, tile.nbytes)
        return slot, time.perf_counter() - start

    def _plan_new(self, tile: _Tile, entries: list[tuple[str, torch.dtype]]) -> AlignedBuffer:
        """A tile's first write: lay it out, check the disk has room, hand out a buffer for it."""
        tile.plan(entries)
        free = shutil.disk_usage(self.directory).free
        if tile.nbytes > free:
            raise RayZeroValueError(
                f"{self._key}={self._nvme_path!r}: the next {tile.nbytes} bytes of optimizer state do not fit "
                f"({free} bytes free): free space, point nvme_path at a larger disk, or use "
                "offload_optimizer.device \"cpu\"")
        return self._acquire(tile.nbytes)

    def _template(self, optimizer: torch.optim.Optimizer) -> dict | None:
        if not hasattr(self, "_zero_template"):
            self._zero_template = zero_state_template(optimizer)
        return self._zero_template

    # ---- the step ([Note: NVMe tiles]) -------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        masters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        tiles = [tile for master in masters for tile in self._tiles_of(master)]
        owners = _owner_groups(optimizer)
        timings = {"cpu_step": 0.0, "nvme_read": 0.0, "nvme_write": 0.0}
        reads: dict[int, Future] = {}
        writes: list[Future] = []
        scalars: dict[int, dict] = {}
        try:
            for index, tile in enumerate(tiles):
                master_state = optimizer.state[tile.master]
                slot = None
                if tile.layout:
                    if index not in reads:
                        reads[index] = self._driver.submit(self._read, tile)
                    slot, seconds = reads.pop(index).result()
                    timings["nvme_read"] += seconds
                ahead = index + 1
                if self.pipeline_read and ahead < len(tiles) and tiles[ahead].layout:
                    reads[ahead] = self._driver.submit(self._read, tiles[ahead])
                proxy_state = {}
                if slot is None and self._template(optimizer) is not None:
                    # First step from zeroed state in the tile's own buffer: no tile-sized allocation
                    # that the allocator might keep (exactly torch's first step: zero_state_template).
                    template = self._template(optimizer)
                    slot = self._plan_new(tile, [(k, v.dtype) for k, v in template.items() if _elementwise(v, 3)])
                    proxy_state = {k: torch.zeros_like(v) for k, v in template.items() if not _elementwise(v, 3)}
                    proxy_state.update({key: tile.view(slot, offset, dtype).zero_() for key, offset, dtype in tile.layout})
                elif slot is not None:  # scalars copied (torch increments `step` in place), entries bound
                    proxy_state = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                   for k, v in master_state.items() if not _elementwise(v, tile.master.numel())}
                    proxy_state.update({key: tile.view(slot, offset, dtype) for key, offset, dtype in tile.layout})
                start = time.perf_counter()
                with cpu_threads(self.step_threads):
                    proxy_state = _step_proxy(optimizer, tile, proxy_state, owners[id(tile.master)])
                timings["cpu_step"] += time.perf_counter() - start
                entries = {k: v for k, v in proxy_state.items() if _elementwise(v, tile.numel)}
                if not tile.layout:  # first step: torch created the (tile-sized) state; move it to a buffer
                    slot = self._plan_new(tile, [(k, v.dtype) for k, v in entries.items()])
                    for key, offset, dtype in tile.layout:
                        tile.view(slot, offset, dtype).copy_(entries[key])
                scalars[id(tile.master)] = {k: v for k, v in proxy_state.items() if k not in entries}
                write = self._driver.submit(self._write, tile, slot)
                if self.pipeline_write:
                    writes.append(write)
                else:
                    timings["nvme_write"] += write.result()
            for master in masters:
                state = optimizer.state[master]
                state.update(scalars[id(master)])
                for key, _, dtype in self._tiles_of(master)[0].layout:
                    state[key] = torch.empty(master.shape, dtype=dtype, device="meta")
        finally:
            for future in [*reads.values(), *writes]:
                try:
                    result = future.result()
                except Exception:  # noqa: BLE001 - the step's own error is the one to raise
                    continue
                if isinstance(result, float):
                    timings["nvme_write"] += result
                else:
                    self._free.put(result[0])
            self._timings = timings

    # ---- checkpoints and accounting --------------------------------------------------------------
    @contextlib.contextmanager
    def resident(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Every state tensor in ordinary memory inside the block; written back and released after
        (state created inside, e.g. by a checkpoint load into a fresh optimizer, is swapped out too)."""
        masters = [p for group in optimizer.param_groups for p in group["params"]]
        for master in masters:
            tiles = self._tiles.get(id(master))
            if not tiles or not tiles[0].layout:
                continue
            state = optimizer.state[master]
            for key, _, dtype in tiles[0].layout:
                state[key] = torch.empty(master.shape, dtype=dtype)
            for tile in tiles:
                slot, _ = self._read(tile)
                for key, offset, dtype in tile.layout:
                    state[key].view(-1)[tile.start:tile.end].copy_(tile.view(slot, offset, dtype))
                self._free.put(slot)
        try:
            yield
        finally:
            for master in masters:
                state = optimizer.state.get(master) or {}
                entries = {k: v for k, v in state.items()
                           if _elementwise(v, master.numel()) and v.device.type != "meta"}
                if not entries:
                    continue
                for tile in self._tiles_of(master):
                    slot = self._plan_new(tile, [(k, v.dtype) for k, v in entries.items()])
                    for key, offset, dtype in tile.layout:
                        tile.view(slot, offset, dtype).copy_(entries[key].reshape(-1)[tile.start:tile.end])
                    self._write(tile, slot)
                for key, value in entries.items():
                    state[key] = torch.empty(master.shape, dtype=value.dtype, device="meta")

    streams_checkpoints = True

    def checkpoint_piece(self, master: torch.Tensor, key: str, value: torch.Tensor, window: slice):
        if value.device.type != "meta":  # in memory (inside resident(), or not swapped yet)
            return value.detach()[window]
        return _NvmePiece(self, master, key, value.dtype, window.start or 0, window.stop)

    def read_range(self, master: torch.Tensor, key: str, dtype: torch.dtype, start: int, end: int) -> torch.Tensor:
        """State `key` of `master` over elements [start, end), read from the tiles covering it."""
        out = torch.empty(end - start, dtype=dtype)
        for tile in self._tiles.get(id(master), []):
            low, high = max(start, tile.start), min(end, tile.end)
            if low >= high:
                continue
            offset = next((o for k, o, _ in tile.layout if k == key), None)
            if offset is None:
                raise RayZeroValueError(f"internal: optimizer state {key!r} is not in swap file {tile.file.path}")
            slot, _ = self._read(tile)
            try:
                out[low - start:high - start].copy_(tile.view(slot, offset, dtype)[low - tile.start:high - tile.start])
            finally:
                self._free.put(slot)
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "nvme_bytes": self.bytes_on_disk, "io_layer": self.io_layer,
                "swap_dir": self.directory}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for tile in (tile for tiles in self._tiles.values() for tile in tiles):
            with contextlib.suppress(OSError):
                tile.file.close()
        self._tiles.clear()
        for slot in self._slots:
            slot.close()
        self._slots.clear()
        self._driver.shutdown(wait=True)
        self._io.shutdown(wait=True)
        shutil.rmtree(self.directory, ignore_errors=True)
        super().close()  # parameter swap files, if any


class _NvmePiece(LazyPiece):
    """One optimizer-state piece of a checkpoint, read from the swap files when written."""

    def __init__(self, backend: NvmeOffload, master: torch.Tensor, key: str, dtype: torch.dtype,
                 start: int, end: int) -> None:
        super().__init__(end - start, dtype)
        self._read = lambda: backend.read_range(master, key, dtype, start, end)

    def materialize(self) -> torch.Tensor:
        return self._read()
