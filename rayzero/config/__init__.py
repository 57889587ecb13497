"""rayzero.config: the DeepSpeed-compatible configuration (pure pydantic; imports neither torch nor ray).

Public API:
    load_config(source, *, world_size=None, hidden_size=None, trainer=None) -> RayZeroConfig
    RayZeroConfig (to_deepspeed_dict(), from_lightning(**kwargs), notes), ConfigError, Problem,
    RayZeroError (base of every user-facing error), RayZeroValueError, RayZeroRuntimeError
See docs/config.md for every key.
"""
from __future__ import annotations

from rayzero.config.errors import ConfigError, Problem, RayZeroError, RayZeroRuntimeError, RayZeroValueError
from rayzero.config.loader import load_config
from rayzero.config.model import RayZeroConfig
from rayzero.config.offload import OffloadDevice, OffloadOptimizerConfig, OffloadParamConfig
from rayzero.config.sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    FP16Config,
    OptimizerConfig,
    SchedulerConfig,
)
from rayzero.config.zero_optimization import ZeroConfig

__all__ = [
    "ActivationCheckpointingConfig",
    "AioConfig",
    "BF16Config",
    "CheckpointConfig",
    "ConfigError",
    "FP16Config",
    "OffloadDevice",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "Problem",
    "RayZeroConfig",
    "RayZeroError",
    "RayZeroRuntimeError",
    "RayZeroValueError",
    "SchedulerConfig",
    "ZeroConfig",
    "load_config",
]
