"""rayzero.config: the DeepSpeed-compatible configuration (pure pydantic; imports neither torch nor ray).

Public API:
    load_config(source, *, world_size=None, hidden_size=None, trainer=None) -> RayZeroConfig
    RayZeroConfig (to_deepspeed_dict(), from_lightning(**kwargs), notes), ConfigError, Problem,
    RayZeroError (base of every user-facing error), RayZeroValueError, RayZeroRuntimeError
See docs/config.md for every key.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rayzero.config.errors import ConfigError, Problem, RayZeroError, RayZeroRuntimeError, RayZeroValueError

if TYPE_CHECKING:
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

# [Note: the config package loads its models on first use]
# The errors above are all that most of the tree's imports of rayzero.config need (every package's
# errors.py derives from them), and they cost nothing; the pydantic models and the loader cost about
# 0.2-0.3 s of CPU to import. A process that never reads a config (a run's NodeRelay actor, one per
# node per attempt; `rayzero status`) would pay that for every worker it starts, so the names below are
# imported when first asked for (PEP 562), and a module that reads configs imports them as before.
_LAZY = {
    "load_config": "rayzero.config.loader",
    "RayZeroConfig": "rayzero.config.model",
    "OffloadDevice": "rayzero.config.offload",
    "OffloadOptimizerConfig": "rayzero.config.offload",
    "OffloadParamConfig": "rayzero.config.offload",
    "ActivationCheckpointingConfig": "rayzero.config.sections",
    "AioConfig": "rayzero.config.sections",
    "BF16Config": "rayzero.config.sections",
    "CheckpointConfig": "rayzero.config.sections",
    "FP16Config": "rayzero.config.sections",
    "OptimizerConfig": "rayzero.config.sections",
    "SchedulerConfig": "rayzero.config.sections",
    "ZeroConfig": "rayzero.config.zero_optimization",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rayzero.config' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
