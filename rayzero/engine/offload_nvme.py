"""NVMe optimizer offload (ZeRO-Infinity): per-element optimizer state in swap files under
`offload_optimizer.nvme_path`, brought into page-aligned host buffers one tile at a time for the
optimizer step.

[Note: NVMe tiles]
A tile is one tensor the optimizer steps: a bucket's master piece at stages 1-2, a sub-group
(`sub_group_size` elements, cut at parameter boundaries) at stage 3. Between steps a tile's state
entries (`exp_avg`, `exp_avg_sq`, `momentum_buffer`, ...) are shape-only `meta` tensors and the
bytes are in the tile's swap file; scalar state (`step`) stays in memory. A step walks the tiles in
order: read tile i+1 (`pipeline_read`), step tile i, write tile i-1 (`pipeline_write`), with at
most three tile buffers alive — so host memory holds O(largest tile) of optimizer state, not the
whole of it. Without the pipeline flags the three phases run one after another with one buffer.
A tile's first step lets torch create its state, which is then written out.

Swap files are scratch owned by this process: `<nvme_path>/rayzero-swap/<host>-<pid>-<id>-rank<r>/`,
created fresh (never read before this process wrote them, so a restart cannot mistake an old file
for state), removed by `close()` and at exit; directories of processes that no longer exist on this
host are removed at start. Checkpoints hold the state itself ([Note: flat-range partitioning]):
`resident()` brings it into memory around save and load.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import queue
import shutil
import socket
import time
import uuid
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from rayzero.config.errors import RayZeroValueError
from rayzero.engine.offload import _SCRATCH_OWNERS
from rayzero.engine.offload_host import HostOffload
from rayzero.engine.swap_io import AlignedBuffer, IOKnobs, SwapFile, align_up, io_layer_name


@dataclass(eq=False)
class _Tile:
    param: torch.Tensor
    file: SwapFile
    layout: list[tuple[str, int, torch.dtype]] = field(default_factory=list)
    """(state key, byte offset in the file, dtype) of every per-element state entry."""
    nbytes: int = 0

    def plan(self, state: dict) -> None:
        offset = 0
        self.layout = []
        for key in sorted(k for k, v in state.items() if _elementwise(v, self.param)):
            value = state[key]
            self.layout.append((key, offset, value.dtype))
            offset += align_up(value.numel() * value.element_size())
        self.nbytes = offset


def _elementwise(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == param.numel()


@contextlib.contextmanager
def _only(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> Iterator[None]:
    """optimizer.step() inside this block updates just `params` (groups keep their hyperparameters)."""
    keep = {id(p) for p in params}
    saved_groups = optimizer.param_groups
    saved_params = [group["params"] for group in saved_groups]
    try:
        narrowed = []
        for group in saved_groups:
            group["params"] = [p for p in group["params"] if id(p) in keep]
            if group["params"]:
                narrowed.append(group)
        optimizer.param_groups = narrowed
        yield
    finally:
        for group, params in zip(saved_groups, saved_params):
            group["params"] = params
        optimizer.param_groups = saved_groups


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


def _checked_directory(nvme_path: str | None, key: str) -> str:
    if not nvme_path:
        raise RayZeroValueError(f"{key} is missing: NVMe offload needs a directory on a fast local disk, e.g. "
                                f"\"nvme_path\": \"/local_nvme\" (or set device to \"cpu\")")
    try:
        os.makedirs(nvme_path, exist_ok=True)
    except OSError as error:
        raise RayZeroValueError(f"{key}={nvme_path!r} cannot be created ({error.strerror}): point it at a "
                                "writable directory on a local disk") from error
    if not os.access(nvme_path, os.W_OK | os.X_OK):
        raise RayZeroValueError(f"{key}={nvme_path!r} is not writable by this process: point it at a writable "
                                "directory on a local disk")
    return nvme_path


class NvmeOffload(HostOffload):
    """`offload_optimizer.device: nvme` ([Note: offload placement], [Note: NVMe tiles])."""

    name = "nvme"

    def __init__(self, cfg: Any, compute_device: torch.device | str, rank: int = 0) -> None:
        super().__init__(cfg, compute_device)
        self.optimizer_home = "nvme"
        options = cfg.zero_optimization.offload_optimizer
        key = "zero_optimization.offload_optimizer.nvme_path"
        root = os.path.join(_checked_directory(options.nvme_path, key), "rayzero-swap")
        os.makedirs(root, exist_ok=True)
        _remove_stale(root)
        self.directory = os.path.join(
            root, f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}-rank{rank}")
        os.makedirs(self.directory)
        self._key = key
        self.knobs = IOKnobs.from_config(getattr(cfg, "aio", None))
        self.pipeline_read = bool(options.pipeline_read)
        self.pipeline_write = bool(options.pipeline_write)
        self._io = ThreadPoolExecutor(self.knobs.threads, thread_name_prefix="rayzero-swap-io")
        self._driver = ThreadPoolExecutor(1, thread_name_prefix="rayzero-swap")
        self._tiles: dict[int, _Tile] = {}
        self._slots: list[AlignedBuffer] = []
        self._free: queue.Queue = queue.Queue()
        self.bytes_on_disk = 0
        self._closed = False
        probe = SwapFile(os.path.join(self.directory, "probe"), self._io, self.knobs)
        self.direct = probe.direct
        probe.close()
        if not self.direct:
            warnings.warn(f"{key}={options.nvme_path!r}: the filesystem refuses O_DIRECT (tmpfs or a FUSE mount?); "
                          "swap files use buffered I/O through the page cache, which holds the state in memory "
                          "again. Point nvme_path at a local disk", stacklevel=3)
        atexit.register(self.close)
        _SCRATCH_OWNERS.add(self)

    @property
    def io_layer(self) -> str:
        return io_layer_name(self.direct)

    # ---- tiles ---------------------------------------------------------------------------------
    def _tile(self, param: torch.Tensor) -> _Tile:
        tile = self._tiles.get(id(param))
        if tile is None:
            path = os.path.join(self.directory, f"tile{len(self._tiles):05d}.swp")
            tile = self._tiles[id(param)] = _Tile(param, SwapFile(path, self._io, self.knobs))
        return tile

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

    def _bind(self, tile: _Tile, state: dict, slot: AlignedBuffer) -> None:
        for key, offset, dtype in tile.layout:
            state[key] = slot.view(offset, tile.param.numel(), dtype).view_as(tile.param)

    def _unbind(self, tile: _Tile, state: dict) -> None:
        for key, _, dtype in tile.layout:
            state[key] = torch.empty(tile.param.shape, dtype=dtype, device="meta")

    def _write(self, tile: _Tile, slot: AlignedBuffer) -> None:
        try:
            tile.file.write(slot, tile.nbytes)
        except OSError as error:
            raise RayZeroValueError(
                f"{self._key}: writing optimizer state to {tile.file.path} failed ({error.strerror or error}); "
                f"{shutil.disk_usage(self.directory).free} bytes are free there. Free space or point nvme_path "
                "at a larger disk") from error
        finally:
            self._free.put(slot)

    def _check_space(self, needed: int) -> None:
        free = shutil.disk_usage(self.directory).free
        if needed > free:
            raise RayZeroValueError(
                f"{self._key}={os.path.dirname(os.path.dirname(self.directory))!r}: the optimizer state of this "
                f"rank needs {needed} bytes of swap space but {free} are free: free space, point nvme_path at a "
                "larger disk, or use offload_optimizer.device \"cpu\"")

    def _swap_out_new(self, tile: _Tile, state: dict) -> None:
        """First step of a tile: torch created its state in memory; move it to the file."""
        tile.plan(state)
        self._check_space(tile.nbytes)
        slot = self._acquire(tile.nbytes)
        for key, offset, dtype in tile.layout:
            slot.view(offset, tile.param.numel(), dtype).copy_(state[key].reshape(-1))
        self._write(tile, slot)
        self.bytes_on_disk += tile.nbytes
        self._unbind(tile, state)

    # ---- the step ([Note: NVMe tiles]) -------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        timings = {"cpu_step": 0.0, "nvme_read": 0.0, "nvme_write": 0.0}
        swapped = [p for p in params if id(p) in self._tiles and self._tiles[id(p)].layout]
        for param in params:
            if not (id(param) in self._tiles and self._tiles[id(param)].layout):
                start = time.perf_counter()
                with _only(optimizer, [param]):
                    optimizer.step()
                timings["cpu_step"] += time.perf_counter() - start
                state = optimizer.state.get(param)
                if state:
                    start = time.perf_counter()
                    self._swap_out_new(self._tile(param), state)
                    timings["nvme_write"] += time.perf_counter() - start
        self._step_swapped(optimizer, swapped, timings)
        self._timings = timings

    def _read(self, tile: _Tile) -> tuple[AlignedBuffer, float]:
        slot = self._acquire(tile.nbytes)
        start = time.perf_counter()
        tile.file.read(slot, tile.nbytes)
        return slot, time.perf_counter() - start

    def _timed_write(self, tile: _Tile, slot: AlignedBuffer) -> float:
        start = time.perf_counter()
        self._write(tile, slot)
        return time.perf_counter() - start

    def _step_swapped(self, optimizer: torch.optim.Optimizer, params: list, timings: dict) -> None:
        tiles = [self._tiles[id(p)] for p in params]
        reads: dict[int, Future] = {}
        writes: list[Future] = []
        try:
            for index, tile in enumerate(tiles):
                if index not in reads:
                    reads[index] = self._driver.submit(self._read, tile)
                slot, seconds = reads.pop(index).result()
                timings["nvme_read"] += seconds
                if self.pipeline_read and index + 1 < len(tiles):
                    reads[index + 1] = self._driver.submit(self._read, tiles[index + 1])
                state = optimizer.state[tile.param]
                self._bind(tile, state, slot)
                start = time.perf_counter()
                with _only(optimizer, [tile.param]):
                    optimizer.step()
                timings["cpu_step"] += time.perf_counter() - start
                self._unbind(tile, state)  # the slot still holds the values until written
                write = self._driver.submit(self._timed_write, tile, slot)
                if self.pipeline_write:
                    writes.append(write)
                else:
                    timings["nvme_write"] += write.result()
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

    # ---- checkpoints and accounting --------------------------------------------------------------
    @contextlib.contextmanager
    def resident(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Every state tensor in ordinary memory inside the block; written back and released after
        (state created inside, e.g. by a checkpoint load into a fresh optimizer, is swapped out too)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for param in params:
            tile = self._tiles.get(id(param))
            if tile is None or not tile.layout:
                continue
            slot, _ = self._read(tile)
            state = optimizer.state[param]
            for key, offset, dtype in tile.layout:
                state[key] = slot.view(offset, param.numel(), dtype).clone().view_as(param)
            self._free.put(slot)
        try:
            yield
        finally:
            for param in params:
                state = optimizer.state.get(param)
                if state and any(_elementwise(v, param) and v.device.type != "meta" for v in state.values()):
                    tile = self._tile(param)
                    had = tile.nbytes if tile.layout else 0
                    self._swap_out_new(tile, state)
                    self.bytes_on_disk -= had

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "nvme_bytes": self.bytes_on_disk, "io_layer": self.io_layer,
                "swap_dir": self.directory}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for tile in self._tiles.values():
            with contextlib.suppress(OSError):
                tile.file.close()
        self._tiles.clear()
        for slot in self._slots:
            slot.close()
        self._slots.clear()
        self._driver.shutdown(wait=True)
        self._io.shutdown(wait=True)
        shutil.rmtree(self.directory, ignore_errors=True)
