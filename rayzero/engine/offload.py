"""The offload seam: one object decides where fp32 master weights, optimizer state and (stage 3)
parameter shards live, and runs the optimizer step there.

Strategies never allocate those tensors themselves and never assume they sit on the compute
device: they ask the backend for storage, copy gradients into it with `.copy_()` (which crosses
devices), and call `backend.step(optimizer)`. This issue ships `none` (everything on the compute
device); `cpu` and `nvme` plug in here without touching the stage classes.
"""
from __future__ import annotations

import abc
import enum
from typing import Any

import torch

from rayzero.config.errors import RayZeroValueError


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
    def allocate(self, kind: StateKind, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed 1-D tensor of `numel` elements for `kind`, wherever this backend keeps it."""

    @abc.abstractmethod
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Run `optimizer.step()` where the state lives (tiled/overlapped for NVMe)."""

    def fused_optimizer_kwargs(self) -> dict:
        """Keyword arguments that select the fastest torch optimizer implementation here."""
        if self.device.type == "cuda":
            return {"fused": True}
        return {"foreach": True}


class NoOffload(OffloadBackend):
    """Everything stays on the compute device (offload `none`)."""

    name = "none"

    def __init__(self, device: torch.device) -> None:
        self._device = torch.device(device)

    @property
    def device(self) -> torch.device:
        return self._device

    def allocate(self, kind: StateKind, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self._device)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


_AVAILABLE_DEVICES = ("none",)
"""Offload devices this release implements; CPU and NVMe backends plug in here."""


def unsupported_offload(zero_config: Any) -> list[tuple[str, str]]:
    """(config key, device) for every offload setting this release cannot honour.

    Both keys are checked: a silently ignored `offload_param` would leave parameters on the GPU
    while the user planned memory around them being elsewhere. The driver calls this before any
    worker starts; `rayzero.initialize` calls it again for loops run without the driver.
    """
    asked = (("zero_optimization.offload_optimizer.device", zero_config.offload_optimizer_device),
             ("zero_optimization.offload_param.device", zero_config.offload_param_device))
    return [(key, device) for key, device in asked if device not in _AVAILABLE_DEVICES]


def build_offload_backend(zero_config: Any, compute_device: torch.device) -> OffloadBackend:
    """The backend for `zero_optimization.offload_*` (`none` only in this release)."""
    unsupported = unsupported_offload(zero_config)
    if unsupported:
        raise RayZeroValueError("; ".join(
            f"{key}={device!r} is not available in this build" for key, device in unsupported)
            + ": use 'none' or remove the offload section (CPU/NVMe offload backends plug into "
            "rayzero.engine.offload)")
    return NoOffload(compute_device)
