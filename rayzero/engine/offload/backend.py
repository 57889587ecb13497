"""The offload seam: one object decides where fp32 master weights, optimizer state and (stage 3)
parameter shards live, and runs the optimizer step there.

Strategies never allocate those tensors themselves and never assume they sit on the compute
device: they ask the backend for storage, copy gradients into it with `.copy_()` (which crosses
devices), and call `backend.step(optimizer)`. Three backends, chosen by
`zero_optimization.offload_optimizer.device` / `offload_param.device` exactly as DeepSpeed's keys:
`none` (NoOffload, here), `cpu` (host.HostOffload) and `nvme` (nvme.NvmeOffload).
See [Note: offload placement] in host.py for what lives where in each mode.
"""
from __future__ import annotations

import abc
import contextlib
import enum
import weakref
from collections.abc import Iterator
from typing import Any

import torch

_SCRATCH_OWNERS: weakref.WeakSet = weakref.WeakSet()
"""Backends holding scratch files (NVMe swap), closed by `release_scratch` when a loop ends."""


def release_scratch() -> None:
    """Close every live backend's scratch storage (swap files). The Ray worker calls this when the
    user's loop returns or fails, since loops rarely call `engine.close()`; idempotent."""
    for backend in list(_SCRATCH_OWNERS):
        backend.close()

class StateKind(enum.Enum):
    """What a buffer the strategy asks for will hold."""

    MASTER = "master"
    """fp32 master weights (a shard in stages 1-3)."""
    MASTER_GRAD = "master_grad"
    """fp32 gradients the optimizer reads (a shard in stages 1-3)."""
    PARAM_SHARD = "param_shard"
    """Stage 3: this rank's shard of a compute-dtype parameter."""


class OffloadBackend(abc.ABC):
    """Owns the storage of partitioned training state and runs the optimizer step on it."""

    name: str

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where master weights and optimizer state live (the optimizer is built over tensors here)."""

    @abc.abstractmethod
    def allocate(self, kind: StateKind, numel: int, dtype: torch.dtype, offloaded: bool = True) -> torch.Tensor:
        """A zeroed 1-D tensor of `numel` elements for `kind`, wherever this backend keeps it;
        `offloaded=False`: on the compute device even so (a stage-3 sub-group that partial offload,
        `ratio`, keeps there: [Note: partial offload])."""

    def sub_groups_offloaded(self, count: int) -> list[bool]:
        """Stage 3: which of `count` optimizer sub-groups (in order) live off the device."""
        return [self.optimizer_home != "device"] * count

    def device_resident_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of masters, their gradients and optimizer state that partial offload keeps on the
        compute device although the optimizer is offloaded (memory_stats' placement)."""
        return 0

    @abc.abstractmethod
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Run `optimizer.step()` where the state lives (tiled/overlapped for NVMe)."""

    optimizer_home: str = "device"
    """Where optimizer state lives: `device`, `host` or `nvme` (memory_stats' placement)."""
    param_home: str = "device"
    """Where stage-3 parameter shards live between uses: `device`, `host` or `nvme`."""

    def may_alias(self, compute_device: torch.device | str) -> bool:
        """True when an fp32 master may *be* the compute parameter (same tensor, no copy): only
        when nothing is offloaded. An offloading backend keeps masters apart even on a CPU-only
        machine, so the path that runs is the one that runs with an accelerator."""
        return False

    def fused_optimizer_kwargs(self) -> dict:
        """Keyword arguments that select the fastest torch optimizer implementation here: torch's
        fused kernels exist for CUDA and, since torch 2.4, for the CPU (Adam, AdamW, SGD; ~5x
        faster than `foreach` on CPU, ENVIRONMENT.md)."""
        return {"fused": True}

    @contextlib.contextmanager
    def resident(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Within this block every optimizer state tensor is in memory (checkpoint save/load)."""
        yield

    streams_checkpoints: bool = False
    """True when optimizer state is not in memory between steps and a save reads it piece by piece
    through `checkpoint_piece` instead of `resident()` ([Note: streamed save])."""

    def checkpoint_piece(self, master: torch.Tensor, key: str, value: torch.Tensor, window: slice):
        """The checkpoint's view of optimizer state `key` of `master` over `window` (a slice of the
        master's elements): a tensor view, or a checkpoint LazyPiece where the state is on disk."""
        return value.detach()[window]

    def background_stepper(self):
        """A stepper that runs the optimizer on one bucket at a time while backward goes on, or
        None where the step must run after backward ([Note: step overlapped with backward])."""
        return None

    def param_store(self):
        """Stage 3: where parameter shards swapped to NVMe live (nvme_param_store.NvmeParamStore),
        or None when shards are tensors ([Note: NVMe parameter shards])."""
        return None

    def before_forward(self) -> None:
        """Stage 3, at every forward: start reading the first swapped shards back ([Note: NVMe parameter shards])."""

    def after_publish(self) -> None:
        """Stage 3, once the step's updated shards were handed over: the step's parameter I/O is
        complete ([Note: NVMe parameter shards])."""

    def record_transfers(self, d2h: float, h2d: float) -> None:
        """Seconds the last step spent putting reduced gradients into the offloaded master
        gradients (`d2h`: the device-to-host copies) and bringing updated masters back to the
        parameters (`h2d_publish`: host-to-device copies and the all-gather that follows them), as
        the strategy measured them (for `breakdown`)."""

    def record_overlapped_step(self, seconds: float, exposed: float) -> None:
        """Timings of a step that ran during backward (for `breakdown`)."""

    def breakdown(self) -> dict[str, float]:
        """Seconds spent in the last optimizer step's parts (cpu_step, nvme_read, nvme_write)."""
        return {}

    def describe(self) -> dict[str, Any]:
        """What runs where (for memory_stats and the run's log)."""
        return {"optimizer": self.optimizer_home, "params": self.param_home}

    def close(self) -> None:
        """Release scratch storage (NVMe swap files)."""


class NoOffload(OffloadBackend):
    """Everything stays on the compute device (offload `none`)."""

    name = "none"

    def __init__(self, device: torch.device) -> None:
        self._device = torch.device(device)

    def may_alias(self, compute_device: torch.device | str) -> bool:
        return self._device == torch.device(compute_device)

    @property
    def device(self) -> torch.device:
        return self._device

    def allocate(self, kind: StateKind, numel: int, dtype: torch.dtype, offloaded: bool = True) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self._device)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


def build_offload_backend(cfg: Any, compute_device: torch.device, rank: int = 0) -> OffloadBackend:
    """The backend for `zero_optimization.offload_optimizer` / `offload_param` (see module doc)."""
    zero = cfg.zero_optimization
    if zero.offload_optimizer_device == "none" and zero.offload_param_device == "none":
        return NoOffload(compute_device)
    if zero.offload_optimizer_device == "nvme":
        from rayzero.engine.offload.nvme import NvmeOffload
        return NvmeOffload(cfg, compute_device, rank)
    from rayzero.engine.offload.host import HostOffload
    return HostOffload(cfg, compute_device)
