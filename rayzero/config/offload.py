"""`zero_optimization.offload_param` and `zero_optimization.offload_optimizer`.

Attribute names and defaults follow deepspeed/runtime/zero/offload_config.py.
"""
from __future__ import annotations

from enum import Enum
from typing import Optional

from pydantic import Field

from rayzero.config.base import STAGE3_ONLY, UNIMPLEMENTED, Bool, ConfigModel, Float, Int


class OffloadDevice(str, Enum):
    """Where offloaded tensors live."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadParamConfig(ConfigModel):
    """Stage 3 only: keep parameter shards in CPU memory or on NVMe between uses."""

    device: OffloadDevice = OffloadDevice.none
    """Where parameter shards live: `none` (accelerator memory), `cpu`, or `nvme`."""
    nvme_path: Optional[str] = None
    """Directory on a fast local NVMe drive for parameter swap files; required when device is `nvme`.
    It must exist on every node: rayzero does not create it (DeepSpeed does), so a mistyped path is an
    error, not swap files on another disk."""
    buffer_count: Int = Field(5, ge=0)
    """Number of pinned staging buffers used to swap parameters in from NVMe."""
    buffer_size: Int = Field(100_000_000, ge=0)
    """Size in elements of each NVMe staging buffer; must hold the largest parameter."""
    max_in_cpu: Int = Field(1_000_000_000, ge=0)
    """Number of parameter elements kept in CPU memory when swapping to NVMe."""
    pin_memory: Bool = False
    """Pin the CPU copies (page-locked) for faster host-device copies; ignored without an accelerator."""


class OffloadOptimizerConfig(ConfigModel):
    """Keep fp32 master weights and optimizer state in CPU memory or on NVMe and step there."""

    device: OffloadDevice = OffloadDevice.none
    """Where optimizer state lives and the optimizer step runs: `none`, `cpu`, or `nvme`."""
    nvme_path: Optional[str] = None
    """Directory on a fast local NVMe drive for optimizer swap files; required when device is `nvme`.
    It must exist on every node: rayzero does not create it (DeepSpeed does), so a mistyped path is an
    error, not swap files on another disk."""
    buffer_count: Int = Field(4, ge=0, json_schema_extra={UNIMPLEMENTED: True})
    """DeepSpeed: staging buffers for optimizer-state swapping. Recognised, not used: rayzero's NVMe
    step holds at most three tile buffers, each with every state tensor of its tile."""
    pin_memory: Bool = False
    """Pin the CPU copies (page-locked) for faster host-device copies; ignored without an accelerator."""
    pipeline_read: Bool = False
    """NVMe: read the next sub-group's state while the current one steps."""
    pipeline_write: Bool = False
    """NVMe: write the previous sub-group's state back while the current one steps."""
    fast_init: Bool = Field(False, json_schema_extra={UNIMPLEMENTED: True})
    """Initialise NVMe optimizer state quickly (skip writing zeros); recognised, not implemented."""
    ratio: Float = Field(1.0, ge=0.0, le=1.0, json_schema_extra={STAGE3_ONLY: True})
    """Fraction of optimizer state offloaded (ZeRO-3 partial offload); values below 1 need stage 3."""
