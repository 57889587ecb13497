"""rayzero.workers: the Ray actor adapter (env -> process group -> user loop -> report).

Inside a loop started by `rayzero.fit` (or `rayzero run`): `get_context()`, `report(metrics)`,
`get_dataset_shard(name)`. See [Note: the worker session] in `session.py`.
"""
from rayzero.workers.boundary import RunStopped
from rayzero.workers.errors import RayZeroRuntimeError, WorkerSetupError
from rayzero.workers.session import (
    Report,
    TrainContext,
    get_context,
    get_dataset_shard,
    local_reports,
    report,
)

__all__ = [
    "RayZeroRuntimeError",
    "Report",
    "RunStopped",
    "TrainContext",
    "WorkerSetupError",
    "get_context",
    "get_dataset_shard",
    "local_reports",
    "report",
]
