"""rayzero: ZeRO stages 0-3 with CPU/NVMe offload on Ray, fault tolerant, on Kubernetes.

The public names are imported lazily so that `import rayzero` stays cheap (no torch, no ray)
for the CLI's config commands and for the operator.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    # configuration (rayzero.config)
    "RayZeroConfig": "rayzero.config",
    "ConfigError": "rayzero.config",
    "RayZeroError": "rayzero.config",  # base of every user-facing error
    # the training-loop API, DeepSpeed's shapes (rayzero.engine)
    "initialize": "rayzero.engine",
    "add_config_arguments": "rayzero.engine",
    "init_distributed": "rayzero.engine",
    "ZeroEngine": "rayzero.engine",
    # the driver API, Ray Train's shapes (rayzero.driver)
    "fit": "rayzero.driver.fit",
    "ScalingConfig": "rayzero.driver",
    "RunConfig": "rayzero.driver",
    "FailureConfig": "rayzero.driver",
    "Result": "rayzero.driver.fit",
    "TrainingFailedError": "rayzero.driver",
    "read_metrics": "rayzero.driver.metrics_store",  # a run's metrics.parquet as one table
    # a training script run as __main__ on every worker, as torchrun would (rayzero run SCRIPT.py)
    "Script": "rayzero.integrations.script_args",
    # inside a train loop run by rayzero.fit (rayzero.workers)
    "get_context": "rayzero.workers",
    "report": "rayzero.workers",
    "get_dataset_shard": "rayzero.workers",
}
# sub-modules reachable as attributes, e.g. rayzero.zero.GatheredParameters,
# rayzero.activation_checkpointing.checkpoint (DeepSpeed's name for it: rayzero.checkpointing)
_SUBMODULES = {"zero": "rayzero.zero", "activation_checkpointing": "rayzero.activation_checkpointing",
               "checkpointing": "rayzero.checkpointing"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rayzero' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY) + list(_SUBMODULES))
