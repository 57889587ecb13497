"""`deepspeed.comm`: DeepSpeed's collective API over torch.distributed (the group rayzero trains on).

DeepSpeed's wrappers take profiling keywords (`prof`, `log_name`, `debug`) that torch's functions do
not; they are accepted and dropped here (rayzero counts its own traffic in rayzero.engine.comm). Any
other torch.distributed name is reached through the module's `__getattr__`, with torch's signature.
"""
from __future__ import annotations

import datetime
import os
import sys
from typing import Any

import torch.distributed as dist

from rayzero.engine.distributed import init_distributed as _init_process_group

ReduceOp = dist.ReduceOp
_PROFILING = ("prof", "log_name", "debug")
DEFAULT_PORT = 29500  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = DEFAULT_PORT, verbose: bool = True,
                     timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Form the default process group from the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), unless one exists. `dist_backend` None picks the accelerator's (nccl with CUDA, gloo
    otherwise), as DeepSpeed does. MPI discovery is not done: launch with `rayzero run` or torchrun."""
    if not dist.is_initialized() and dist_init_required is not False:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
        timeout_s = timeout.total_seconds() if timeout is not None else None
        if init_method is not None:
            from rayzero.compat.accelerator import get_accelerator

            dist.init_process_group(dist_backend or get_accelerator().communication_backend_name(),
                                    init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=timeout)
        else:
            _init_process_group(dist_backend, timeout_s)
    _tell_accelerate(dist.get_backend() if dist.is_initialized() else None)


def _tell_accelerate(backend: str | None) -> None:
    """[Note: the DeepSpeed compatibility layer], item 1: accelerate's `PartialState`, while it is
    being built, asks `is_initialized()` and then calls `init_distributed()` unless a group exists,
    having kept `backend=None` on a machine without accelerators; record the backend the group uses
    so it takes world size and ranks from the group. No effect once accelerate has a backend."""
    state_module = sys.modules.get("accelerate.state")
    if backend is None or state_module is None:
        return
    shared = state_module.PartialState._shared_state
    if "backend" in shared and shared["backend"] is None and os.environ.get(
            "ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        shared["backend"] = backend


def is_initialized() -> bool:
    initialized = dist.is_initialized()
    if initialized:  # a group the script formed itself: accelerate skips init_distributed
        _tell_accelerate(dist.get_backend())
    return initialized


def is_available() -> bool:
    return dist.is_available()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group)


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_world_group() -> Any:
    return dist.group.WORLD


def new_group(ranks: list[int]) -> Any:
    return dist.new_group(ranks)


def _drop_profiling(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in kwargs.items() if key not in _PROFILING}


def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op, **_drop_profiling(kwargs))


def broadcast(tensor: Any, src: int, group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
    return dist.broadcast(tensor, src, group=group, async_op=async_op, **_drop_profiling(kwargs))


def all_gather(tensor_list: list, tensor: Any, group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op, **_drop_profiling(kwargs))


def all_gather_into_tensor(output_tensor: Any, tensor: Any, group: Any = None, async_op: bool = False,
                           **kwargs: Any) -> Any:
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op,
                                       **_drop_profiling(kwargs))


def reduce_scatter_tensor(output_tensor: Any, tensor: Any, op: Any = ReduceOp.SUM, group: Any = None,
                          async_op: bool = False, **kwargs: Any) -> Any:
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op,
                                      **_drop_profiling(kwargs))


def reduce(tensor: Any, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
           **kwargs: Any) -> Any:
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op, **_drop_profiling(kwargs))


def all_gather_object(object_list: list, obj: Any, group: Any = None, **kwargs: Any) -> Any:
    return dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: list, src: int, group: Any = None, device: Any = None,
                          **kwargs: Any) -> Any:
    return dist.broadcast_object_list(object_list, src, group=group, device=device)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, **kwargs: Any) -> Any:
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def destroy_process_group(group: Any = None) -> None:
    dist.destroy_process_group(group)


def __getattr__(name: str) -> Any:
    """Other torch.distributed names (send, recv, all_to_all_single, ...), with torch's signatures."""
    if not name.startswith("_") and hasattr(dist, name):
        return getattr(dist, name)
    raise AttributeError(f"module 'deepspeed.comm' (rayzero) has no attribute {name!r}")
