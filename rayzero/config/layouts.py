"""Rules for stage 3's layouts beyond one node: ZeRO++ (hpZ, qwZ, qgZ) and MiCS.

What each key means is in zero_optimization.py and [Note: stage-3 layouts] (engine/stage3/layout.py).
Checked here, before any worker starts: the combinations that cannot run, and a group size that does
not divide the world. Whether a group splits a node is known only once the workers are placed: the
engine checks that when it starts, before the first step.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rayzero.config.errors import Problem
from rayzero.config.model import RayZeroConfig

_ZERO = "zero_optimization"


def group_sizes(config: RayZeroConfig) -> dict[str, int]:
    """{key: ranks per group} for the layout keys that are on (stage 3 only)."""
    zero = config.zero_optimization
    if zero.stage != 3:
        return {}
    out = {}
    if isinstance(zero.mics_shard_size, int) and zero.mics_shard_size > 0:
        out["mics_shard_size"] = zero.mics_shard_size
    if isinstance(zero.zero_hpz_partition_size, int) and zero.zero_hpz_partition_size > 1:
        out["zero_hpz_partition_size"] = zero.zero_hpz_partition_size
    return out


def world_multiple(config: RayZeroConfig) -> int:
    """Every world size the run takes must be a multiple of this (1: any)."""
    multiple = 1
    for size in group_sizes(config).values():
        multiple = multiple * size // _gcd(multiple, size)
    return multiple


def raw_world_multiple(raw: Mapping[str, Any] | None) -> tuple[int, str]:
    """`world_multiple` of a DeepSpeed config dict as the user wrote it (the controller's elastic plan
    reads the raw config), and the keys behind it ('' when 1)."""
    zero = (raw or {}).get("zero_optimization") or {}
    if not isinstance(zero, Mapping) or zero.get("stage") != 3:
        return 1, ""
    multiple, keys = 1, []
    for key, low in (("mics_shard_size", 0), ("zero_hpz_partition_size", 1)):
        value = zero.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > low:
            multiple = multiple * value // _gcd(multiple, value)
            keys.append(f"zero_optimization.{key}={value}")
    return multiple, " and ".join(keys)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def check_layouts(config: RayZeroConfig, world_size: int | None, notes: list[str], problems: list[Problem]) -> None:
    zero = config.zero_optimization
    if zero.stage != 3:
        return  # the stage-3-only note says these are ignored
    sizes = group_sizes(config)
    if "mics_shard_size" in sizes and "zero_hpz_partition_size" in sizes:
        problems.append(Problem(
            f"{_ZERO}.zero_hpz_partition_size", zero.zero_hpz_partition_size,
            f"cannot be combined with {_ZERO}.mics_shard_size={zero.mics_shard_size}: MiCS already keeps every "
            "gather inside its shard group, and DeepSpeed's MiCS never built hpZ's secondary partition "
            "(DeepSpeed 0.19 removed MiCS altogether)",
            "use one: mics_shard_size (shard inside groups, replicate across them) or zero_hpz_partition_size "
            "(shard over every rank, gather backward inside the node)"))
    if zero.mics_hierarchical_params_gather and "mics_shard_size" in sizes and zero.zero_quantized_weights:
        problems.append(Problem(
            f"{_ZERO}.zero_quantized_weights", True,
            f"cannot be combined with {_ZERO}.mics_hierarchical_params_gather: the hierarchical gather's two "
            "stages carry the compute dtype (DeepSpeed's MiCS never quantized its gathers)",
            "turn one of them off (zero_quantized_weights alone quantizes MiCS's flat gathers inside the "
            "shard group)"))
    if zero.mics_hierarchical_params_gather and "mics_shard_size" not in sizes:
        notes.append(f"ignored: `{_ZERO}.mics_hierarchical_params_gather` = true without {_ZERO}.mics_shard_size: "
                     "it only changes how a MiCS shard group spanning nodes gathers")
    if zero.zero_quantized_gradients and config.communication_data_type is not None:
        notes.append(f"ignored for gradients: `communication_data_type` = {config.communication_data_type!r} with "
                     f"{_ZERO}.zero_quantized_gradients: gradient buckets travel as int4 blocks with fp32 scales")
    if world_size is None:
        return
    for key, size in sizes.items():
        if world_size % size:
            problems.append(Problem(
                f"{_ZERO}.{key}", size, f"does not divide the world size {world_size} (groups of {size} "
                f"consecutive ranks must cover every rank)",
                f"use a divisor of {world_size} (the ranks per node, usually), or run a multiple of {size} workers"))
