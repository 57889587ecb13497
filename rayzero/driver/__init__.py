"""rayzero.driver: `rayzero.fit` and the `rayzero run` / `rayzero demo` commands.

The driver validates the config (before any worker starts), connects to Ray (`RAYZERO_ADDRESS`,
`RAY_ADDRESS`, or a local Ray it starts), starts the controller actor and streams its reports.
"""
from rayzero.controller.configs import FailureConfig, RunConfig, ScalingConfig
from rayzero.controller.errors import ResourcesUnavailableError, TrainingFailedError
from rayzero.driver.fit import Result, fit
from rayzero.workers.errors import RayZeroRuntimeError

__all__ = [
    "FailureConfig",
    "RayZeroRuntimeError",
    "ResourcesUnavailableError",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "TrainingFailedError",
    "fit",
]
