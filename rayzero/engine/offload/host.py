"""CPU offload (ZeRO-Offload): fp32 master weights, their gradients and optimizer state in host
memory, the optimizer step run there by torch's fused CPU kernels; stage-3 parameter shards in host
memory between uses (`offload_param`).

[Note: offload placement]
What lives where, per mode (DeepSpeed's keys; the stage classes only ever call `allocate`):

  offload_optimizer  MASTER, MASTER_GRAD, optimizer state      the step runs
  none               compute device                             on the device
  cpu                host memory (pinned with pin_memory+GPU)   on the host, fused CPU kernel
  nvme               MASTER/MASTER_GRAD in host memory; every   on the host, tile by tile,
                     per-element optimizer state (Adam's two    state read from / written to
                     moments, SGD's momentum) in swap files     swap files (nvme.py)

  offload_param      PARAM_SHARD (stage 3)
  none               compute device
  cpu                host memory (pinned with pin_memory+GPU)
  nvme               the first max_in_cpu elements in host memory, the rest in a swap file read
                     through staging buffers ([Note: NVMe parameter shards])

[Note: partial offload]
`offload_optimizer.ratio` < 1 at stage 3 (DeepSpeed's Twin-Flow): of the optimizer's sub-groups
(`sub_group_size`), the first int((1 - ratio) * count) keep their masters, gradients and optimizer
state on the compute device and step there; the rest are offloaded as above. One torch optimizer
holds both kinds: its fused kernels group tensors by device. With one sub-group (the default
sub_group_size of 1e9 on most models) everything is offloaded, exactly as in DeepSpeed.

Reduced gradients reach MASTER_GRAD with `.copy_()` as each bucket's reduction finishes (stages 0-2:
bucketed/strategy.py's finish callbacks; stage 3: stage3/gradients.py), so device-to-host copies happen during
backward, not after it. Updated masters go back in the strategy's `_publish` (a host-to-device copy,
then the usual all-gather). Offloading backends never alias masters with compute parameters even on
a CPU-only machine, so the tested path is the accelerator path.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

import torch

from rayzero.config.environment import CPU_STEP_THREADS
from rayzero.engine.offload.backend import _SCRATCH_OWNERS, OffloadBackend, StateKind


class HostOffload(OffloadBackend):
    """`offload_optimizer.device: cpu` and/or `offload_param.device: cpu` ([Note: offload placement])."""

    name = "cpu"

    def __init__(self, cfg: Any, compute_device: torch.device | str) -> None:
        zero = cfg.zero_optimization
        self.compute_device = torch.device(compute_device)
        accelerator = self.compute_device.type != "cpu"
        optimizer_cfg, param_cfg = zero.offload_optimizer, zero.offload_param
        self.optimizer_home = "device" if zero.offload_optimizer_device == "none" else "host"
        self.param_home = {"none": "device", "cpu": "host", "nvme": "nvme"}[zero.offload_param_device]
        # Pinning needs an accelerator (pin_memory() raises on CPU-only torch, ENVIRONMENT.md).
        self._pin_state = accelerator and optimizer_cfg is not None and bool(optimizer_cfg.pin_memory)
        self._pin_params = accelerator and param_cfg is not None and bool(param_cfg.pin_memory)
        self._param_store = None
        if zero.offload_param_device == "nvme":
            self._param_store = _param_store(param_cfg, cfg.aio)
            self._own_scratch()
        # [Note: partial offload]: the config keeps ratio < 1 only at stage 3 with device "cpu"
        self.ratio = float(optimizer_cfg.ratio) if optimizer_cfg is not None else 1.0
        self._on_device: list[torch.Tensor] = []  # masters (and their grads) that ratio keeps on the device
        self._timings: dict[str, float] = {}
        self._param_timings: dict[str, float] = {}  # the last step's NVMe parameter I/O (after_publish)
        self.step_threads = step_thread_budget() if self.optimizer_home != "device" else 0

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.optimizer_home != "device" else self.compute_device

    def allocate(self, kind: StateKind, numel: int, dtype: torch.dtype, offloaded: bool = True) -> torch.Tensor:
        if not offloaded and kind is not StateKind.PARAM_SHARD:
            tensor = torch.zeros(numel, dtype=dtype, device=self.compute_device)
            self._on_device.append(tensor)
            return tensor
        if kind is StateKind.PARAM_SHARD:
            if self.param_home == "device":
                return torch.zeros(numel, dtype=dtype, device=self.compute_device)
            return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=self._pin_params)
        if self.optimizer_home == "device":
            return torch.zeros(numel, dtype=dtype, device=self.compute_device)
        return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=self._pin_state)

    def sub_groups_offloaded(self, count: int) -> list[bool]:
        """[Note: partial offload]: DeepSpeed's Twin-Flow split — sub-group i is offloaded when
        i >= int((1 - ratio) * count), so the first ones (in parameter order) stay on the device
        and their step runs there (stage3.py `_create_fp32_partitions` in DeepSpeed 0.19.8)."""
        if self.optimizer_home == "device":
            return [False] * count
        first_offloaded = int((1 - self.ratio) * count)
        return [i >= first_offloaded for i in range(count)]

    def device_resident_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        total = 0
        for tensor in self._on_device:
            total += tensor.numel() * tensor.element_size()
            for value in optimizer.state.get(tensor, {}).values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total

    def may_alias(self, compute_device: torch.device | str) -> bool:
        # Aliasing would put the stage-3 shard where the master is; with offload_param the shard
        # must be a separate host tensor, so only "nothing offloaded" aliases.
        return self.optimizer_home == "device" and self.param_home == "device"

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        start = time.perf_counter()
        with cpu_threads(self.step_threads):
            optimizer.step()
        self._timings = {"cpu_step": time.perf_counter() - start}

    def background_stepper(self):
        from rayzero.engine.offload.overlapped_step import BackgroundStepper, overlap_enabled

        if self.optimizer_home == "device" or not overlap_enabled(self.compute_device):
            return None
        # NVMe steps tile by tile after backward (nvme.py): its thread only copies
        return BackgroundStepper(self.step_subset if self.optimizer_home == "host" else None, self.step_threads)

    def step_subset(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> float:
        """Step only `params` (one bucket's masters): the other parameters are hidden from the
        optimizer for this call. Only the stepper's thread touches the optimizer while backward
        runs ([Note: step overlapped with backward]). Returns the seconds spent."""
        start = time.perf_counter()
        wanted = {id(p) for p in params}
        saved = [group["params"] for group in optimizer.param_groups]
        try:
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in wanted]
            optimizer.step()
        finally:
            for group, kept in zip(optimizer.param_groups, saved):
                group["params"] = kept
        return time.perf_counter() - start

    def record_overlapped_step(self, seconds: float, exposed: float) -> None:
        self._timings = {"cpu_step": seconds, "cpu_step_exposed": exposed}

    def param_store(self):
        return self._param_store

    def before_forward(self) -> None:
        if self._param_store is not None:
            self._param_store.read_ahead_first()

    def after_publish(self) -> None:
        if self._param_store is not None:
            self._param_timings = self._param_store.timings()

    def record_transfers(self, d2h: float, h2d: float) -> None:
        if self.optimizer_home != "device":
            self._timings.update(d2h=d2h, h2d_publish=h2d)

    def breakdown(self) -> dict[str, float]:
        return {**self._timings, **self._param_timings}

    def _own_scratch(self) -> None:
        """This backend holds scratch files: closed at exit and by `release_scratch` (once)."""
        if not getattr(self, "_scratch_owned", False):
            self._scratch_owned = True
            atexit.register(self.close)
            _SCRATCH_OWNERS.add(self)

    def close(self) -> None:
        """Remove the parameter swap file."""
        if self._param_store is not None:
            self._param_store.close()
            shutil.rmtree(self._param_store.directory, ignore_errors=True)

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        if self._param_store is not None:
            out["nvme_param_bytes"] = self._param_store.bytes
            out["param_swap_dir"] = self._param_store.directory
            out["param_staging_bytes"] = self._param_store.staging_bytes
            out["param_staging_buffers_peak"] = self._param_store.buffers_peak
        return out


def step_thread_budget() -> int:
    """Threads for one rank's CPU optimizer step: the cores this process may run on, shared by the
    ranks of this host (LOCAL_WORLD_SIZE) — so several ranks on one host do not oversubscribe it.
    `RAYZERO_CPU_STEP_THREADS` overrides."""
    override = CPU_STEP_THREADS.get()
    if override is not None:
        return max(1, override)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


@contextlib.contextmanager
def cpu_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads capped at `count` inside the block (0: unchanged). A cap, never a
    raise: a process set to fewer threads (Ray actors get their num_cpus) keeps its setting."""
    if count <= 0 or count >= torch.get_num_threads():
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _param_store(param_cfg: Any, aio: Any):
    """The swap file and staging buffers of stage-3 parameter shards ([Note: NVMe parameter shards])."""
    from rayzero.engine.offload.nvme_param_store import NvmeParamStore
    from rayzero.engine.offload.swap_io import IOKnobs, scratch_directory

    directory = scratch_directory(param_cfg.nvme_path, "zero_optimization.offload_param.nvme_path", "params")
    return NvmeParamStore(directory, IOKnobs.from_config(aio), int(param_cfg.buffer_count),
                          int(param_cfg.buffer_size), int(param_cfg.max_in_cpu))
