"""`deepspeed.accelerator.get_accelerator()`: the device rayzero's engine computes on, CPU or CUDA.

DeepSpeed's accelerator object answers "which device, which communication backend, how many
devices" for code that must not hard-code CUDA. rayzero trains on CUDA when torch sees a GPU and on
the CPU otherwise (rayzero.engine.distributed.compute_device), so this answers the same way: on a
CPU-only machine the device is "cpu", the backend "gloo", and each of the LOCAL_WORLD_SIZE
processes on the node counts as one device (DeepSpeed's CPU accelerator counts its launcher's
LOCAL_SIZE the same way). Methods DeepSpeed uses to build its own kernels are refused.
"""
from __future__ import annotations

import os
import resource
from typing import Any

import torch

from rayzero.compat.refused import refuse
from rayzero.engine.distributed import compute_device


class RayZeroAccelerator:
    """DeepSpeed's `DeepSpeedAccelerator` interface for the device rayzero uses."""

    def __init__(self) -> None:
        self._name = "cuda" if torch.cuda.is_available() else "cpu"
        self._communication_backend_name = "nccl" if self._name == "cuda" else "gloo"

    # ---- devices ----------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        if self._name == "cpu" or device_index is None:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> Any:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        if self._name == "cuda":
            return compute_device().index or 0
        return int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return str(compute_device())

    def set_device(self, device_index: int) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        if self._name == "cuda":
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # ---- dtypes -----------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    # ---- random numbers ---------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device_index or "cuda") if self._name == "cuda" else torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.set_rng_state(new_state, device_index or "cuda")
        else:
            torch.set_rng_state(new_state)

    # ---- memory -----------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return torch.cuda.memory_allocated(device_index)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return torch.cuda.max_memory_allocated(device_index)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor  # CPU-only torch cannot pin

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._name == "cuda" else False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        refuse(f"deepspeed.accelerator.get_accelerator().{name}",
               "rayzero's accelerator object answers device, backend, dtype, RNG and memory questions only; "
               "DeepSpeed's op builders, streams and graphs belong to its own kernels")


_ACCELERATOR: RayZeroAccelerator | None = None


def get_accelerator() -> RayZeroAccelerator:
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = RayZeroAccelerator()
    return _ACCELERATOR


def set_accelerator(accelerator: Any) -> None:
    refuse("deepspeed.accelerator.set_accelerator", "rayzero picks CUDA when torch sees a GPU, the CPU otherwise")
