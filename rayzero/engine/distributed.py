"""Process-group setup from the usual environment variables (torchrun, Ray workers, mpirun)."""
from __future__ import annotations

import atexit
import datetime
import os

import torch
import torch.distributed as dist

from rayzero.config.environment import COLLECTIVE_TIMEOUT_S
from rayzero.config.errors import RayZeroValueError

# The collective timeout (RAYZERO_COLLECTIVE_TIMEOUT_S, default 300 s): a rank that never joins fails
# the others within this bound instead of hanging for torch's default 30 minutes (the controller then
# restarts the group).


def compute_device() -> torch.device:
    """cuda:<LOCAL_RANK> when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Initialise the default process group from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.

    No-op when a default group already exists. `backend` defaults to nccl with CUDA, gloo otherwise;
    `timeout_s` defaults to RAYZERO_COLLECTIVE_TIMEOUT_S or 300 s.
    """
    if dist.is_initialized():
        return
    missing = [key for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
    if missing:
        raise RayZeroValueError(
            f"cannot initialise torch.distributed: environment variables {missing} are not set; launch "
            "with torchrun or rayzero.fit, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if timeout_s is None:
        timeout_s = COLLECTIVE_TIMEOUT_S.get()
    if backend == "nccl":
        torch.cuda.set_device(compute_device())
    dist.init_process_group(backend=backend, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=timeout_s))
    atexit.register(_leave_process_group)


def _leave_process_group() -> None:
    """At interpreter exit, leave the group this module created.

    A script run under torchrun that ends without `destroy_process_group()` has gloo abort the
    process at exit ("terminate called without an active exception", seen in most runs with torch
    2.13), which torchrun reports as a failed job. A checkpoint save still in flight finishes first:
    it uses this group's connections.
    """
    if not dist.is_initialized():
        return
    from rayzero.checkpoint.saver import wait_for_pending_saves

    wait_for_pending_saves()
    dist.destroy_process_group()
