"""Activation checkpointing with DeepSpeed's API (`deepspeed.checkpointing`), built on
`torch.utils.checkpoint` (non-reentrant, RNG state preserved so dropout recomputes identically).
Users import it as `rayzero.activation_checkpointing` (or by DeepSpeed's name, `rayzero.checkpointing`).

[Note: activation checkpointing settings]
DeepSpeed keeps its settings in module globals set by `configure()`; here they are one frozen
`CheckpointingSettings` value that `configure()` replaces (and `rayzero.initialize` sets from the
config's `activation_checkpointing` section when the section is given). Per setting:
- `cpu_checkpointing`: the tensors a checkpointed region keeps for its recompute (its inputs) are
  kept as CPU copies; the accelerator copies can be freed. On a CPU-only run it changes nothing.
- `partition_activations`: DeepSpeed splits those inputs across *model-parallel* ranks. rayzero
  has no model parallelism (model-parallel size 1), where DeepSpeed's partition is the whole
  tensor: same behaviour. An `mpu` with a model-parallel size above 1 is refused.
- `contiguous_memory_optimization` / `number_checkpoints`: a contiguous buffer for partitioned
  checkpoints — a memory-layout optimisation only; DeepSpeed's preconditions are checked, then it
  is warned about as not implemented.
- `synchronize_checkpoint_boundary`: synchronise the accelerator before and after each region.
- `profile`: log each region's forward time (rank-local).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
import torch.utils.checkpoint

from rayzero.config.errors import RayZeroValueError

logger = logging.getLogger("rayzero.engine")


@dataclasses.dataclass(frozen=True)
class CheckpointingSettings:
    """DeepSpeed's activation-checkpointing options (config names)."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class _State:
    """The process's current settings ([Note: activation checkpointing settings])."""

    settings = CheckpointingSettings()
    configured = False


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's `deepspeed.checkpointing.configure`: settings from `deepspeed_config` (a path,
    dict or RayZeroConfig; its `activation_checkpointing` section), overridden by the keywords."""
    if mpu_ is not None:
        size_of = getattr(mpu_, "get_tensor_model_parallel_world_size", None) or getattr(
            mpu_, "get_model_parallel_world_size", None)
        if size_of is not None and size_of() > 1:
            raise RayZeroValueError(
                f"rayzero.checkpointing.configure got an mpu with model-parallel size {size_of()}: rayzero has no "
                "model parallelism, so there is nothing to partition activations across; pass mpu_=None")
    values = dataclasses.asdict(CheckpointingSettings())
    if deepspeed_config is not None:
        from rayzero.config import RayZeroConfig, load_config

        config = deepspeed_config if isinstance(deepspeed_config, RayZeroConfig) else load_config(
            deepspeed_config, allow_unresolved=True)
        section = config.activation_checkpointing
        values.update({name: getattr(section, name) for name in values})
    overrides = {"partition_activations": partition_activations, "contiguous_memory_optimization":
                 contiguous_checkpointing, "number_checkpoints": num_checkpoints,
                 "cpu_checkpointing": checkpoint_in_cpu, "synchronize_checkpoint_boundary": synchronize,
                 "profile": profile}
    values.update({name: value for name, value in overrides.items() if value is not None})
    settings = CheckpointingSettings(**values)
    if settings.contiguous_memory_optimization:
        # DeepSpeed asserts both preconditions; then the contiguous buffer itself is layout only.
        if not settings.partition_activations:
            raise RayZeroValueError("activation_checkpointing.contiguous_memory_optimization needs "
                                    "partition_activations: true (as in DeepSpeed)")
        if settings.number_checkpoints is None:
            raise RayZeroValueError("activation_checkpointing.contiguous_memory_optimization needs "
                                    "number_checkpoints (the number of checkpointed layers), as in DeepSpeed")
        logger.warning("activation_checkpointing.contiguous_memory_optimization is not implemented: checkpoints are "
                       "kept in separate tensors (same results; no contiguous buffer)")
    _State.settings = settings
    _State.configured = True


def configure_from_section(section: Any) -> None:
    """Set the settings from a config's `activation_checkpointing` section (rayzero.initialize)."""
    configure(partition_activations=section.partition_activations,
              contiguous_checkpointing=section.contiguous_memory_optimization,
              num_checkpoints=section.number_checkpoints, checkpoint_in_cpu=section.cpu_checkpointing,
              synchronize=section.synchronize_checkpoint_boundary, profile=section.profile)


def is_configured() -> bool:
    """True once `configure` was called (DeepSpeed's name)."""
    return _State.configured


def reset() -> None:
    """Back to DeepSpeed's defaults (nothing configured)."""
    _State.settings = CheckpointingSettings()
    _State.configured = False


def settings() -> CheckpointingSettings:
    """The settings `checkpoint` uses now."""
    return _State.settings


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _to_cpu(value: Any) -> Any:
    # A differentiable copy: gradients still reach the original input; the recompute reads the copy.
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.to("cpu")
    return value


def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """Run `function(*args, **kwargs)` keeping only its inputs; recompute it in backward.

    DeepSpeed's `deepspeed.checkpointing.checkpoint`: same call, same results (gradients and
    dropout masks) as calling `function` directly, with the activations inside freed after forward.
    """
    current = _State.settings
    if current.synchronize_checkpoint_boundary:
        _synchronize()
    start = time.perf_counter() if current.profile else 0.0
    run = function
    if current.cpu_checkpointing:
        devices = [a.device if isinstance(a, torch.Tensor) else None for a in args]
        args = tuple(_to_cpu(a) for a in args)

        def run(*cpu_args: Any, **cpu_kwargs: Any) -> Any:
            moved = [a.to(d) if isinstance(a, torch.Tensor) and d is not None else a
                     for a, d in zip(cpu_args, devices)]
            return function(*moved, **cpu_kwargs)
    output = torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
    if current.synchronize_checkpoint_boundary:
        _synchronize()
    if current.profile:
        logger.info("activation checkpoint forward: %.3f ms", (time.perf_counter() - start) * 1000.0)
    return output


non_reentrant_checkpoint = checkpoint
"""DeepSpeed's name for its non-reentrant variant: the same function here."""
