"""rayzero.driver: `rayzero.fit` and the `rayzero run` / `rayzero demo` commands.

The driver validates the config (before any worker starts), connects to Ray (`RAYZERO_ADDRESS`,
`RAY_ADDRESS`, or a local Ray it starts), starts the controller actor and streams its reports.

The names below are imported when first used, so that `rayzero run` can set Ray's driver-side
logging options before Ray is imported ([Note: rank-prefixed output] in rayzero/workers/rank_output.py).
`rayzero.driver.fit` is the module; the function is `rayzero.fit` (`rayzero.driver.fit.fit`).
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_LAZY = {
    "FailureConfig": "rayzero.config.run_settings",
    "RunConfig": "rayzero.config.run_settings",
    "ScalingConfig": "rayzero.config.run_settings",
    "ResourcesUnavailableError": "rayzero.controller.errors",
    "TrainingFailedError": "rayzero.controller.errors",
    "Result": "rayzero.driver.fit",
    "RayZeroRuntimeError": "rayzero.workers.errors",
}

__all__ = ["FailureConfig", "RayZeroRuntimeError", "ResourcesUnavailableError", "Result", "RunConfig",
           "ScalingConfig", "TrainingFailedError"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rayzero.driver' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
