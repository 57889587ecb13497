"""Which world sizes a run may use, and the batch keys each one gets.

[Note: elastic batch]
A resize must not change the math: the global batch (`train_batch_size`) stays fixed and each world
size gets the `gradient_accumulation_steps` (and, under DeepSpeed's `elasticity` block, the micro
batch) that multiply back to it exactly. A world size with no exact split is not used — it is
skipped with the reason logged, never run with a different global batch. Without an `elasticity`
block the global batch is the config's `train_batch_size`, else micro × gas × max_workers (the size
the run asks for). With `elasticity.enabled` the block decides, as DeepSpeed 0.19.8's
`compute_elastic_config` (version 0.1 algorithm; 0.2 with one GPU per node and no model parallelism
is the same): the final batch and the valid sizes come from `max_train_batch_size` and
`micro_batch_sizes` over highly composite multiples, the micro batch for a size is the largest
listed one that divides the per-rank share.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rayzero.config.errors import RayZeroValueError
from rayzero.config.layouts import raw_world_multiple

# DeepSpeed's elasticity/elasticity.py HCN_LIST: highly composite numbers.
_HCN = [1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080,
        15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640,
        498960, 554400, 665280, 720720]


def _candidate_batch_sizes(bases: list[int], max_batch: int) -> list[int]:
    found = set()
    for base in bases:
        if base >= max_batch:
            found.add(base)
            continue
        ratio = max_batch // base
        index = next((i for i, value in enumerate(_HCN) if value > ratio), 0)
        found.add(_HCN[index - 1] * base)
    return sorted(found)


def _valid_sizes(batch: int, micro_batches: list[int], min_size: int, max_size: int) -> list[int]:
    sizes = set()
    for micro in micro_batches:
        if batch % micro:
            continue
        most = batch // micro
        if min_size <= most <= max_size:
            sizes.add(most)
        for size in range(1, most // 2 + 1):
            if size > max_size:
                break
            if size >= min_size and most % size == 0:
                sizes.add(size)
    return sorted(sizes)


def deepspeed_elastic_batch(micro_batches: list[int], max_batch: int, min_gpus: int, max_gpus: int,
                            prefer_larger: bool) -> tuple[int, list[int]]:
    """(final global batch, valid world sizes) as DeepSpeed's `_get_compatible_gpus_v01`."""
    if any(micro > max_batch for micro in micro_batches):
        raise RayZeroValueError(f"elasticity.micro_batch_sizes {micro_batches} has a size above "
                                f"elasticity.max_train_batch_size={max_batch}; lower it or raise the maximum")
    bases = sorted(set(micro_batches)) + [math.lcm(*micro_batches)]
    best_batch, best_sizes = int(min(micro_batches)), []
    for batch in _candidate_batch_sizes(bases, max_batch):
        sizes = _valid_sizes(batch, micro_batches, min_gpus, max_gpus)
        better = len(sizes) > len(best_sizes) or (len(sizes) == len(best_sizes) and (
            (prefer_larger and batch > best_batch) or (not prefer_larger and batch < best_batch)))
        if better:
            best_batch, best_sizes = batch, sizes
    return best_batch, best_sizes


@dataclass(frozen=True)
class BatchSplit:
    """The batch keys of one world size."""

    world_size: int
    micro_batch: int
    gradient_accumulation_steps: int


@dataclass(frozen=True)
class BatchPlan:
    """The fixed global batch and how each world size in [min_workers, max_workers] splits it."""

    min_workers: int
    max_workers: int
    train_batch_size: int | None
    """None when the config sets no batch at all (the loop batches on its own: every size is valid)."""
    splits: dict[int, BatchSplit] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)
    """World size -> why it cannot keep the global batch."""

    def valid_sizes(self) -> list[int]:
        if self.train_batch_size is None:
            return [size for size in range(self.min_workers, self.max_workers + 1) if size not in self.skipped]
        return sorted(self.splits)

    def choose(self, fitting: int | None) -> int | None:
        """The largest valid size <= `fitting` workers (None: unknown, take the largest); None if none."""
        limit = self.max_workers if fitting is None else min(fitting, self.max_workers)
        usable = [size for size in self.valid_sizes() if size <= limit]
        return max(usable) if usable else None

    def check(self, workers: int) -> None:
        """Raise RayZeroValueError naming the fix when `workers` cannot be used."""
        if not self.min_workers <= workers <= self.max_workers:
            raise RayZeroValueError(f"cannot scale to {workers} workers: the run's elastic range is "
                                    f"{self.min_workers}:{self.max_workers} (ScalingConfig.num_workers)")
        if workers in self.skipped:
            raise RayZeroValueError(f"cannot scale to {workers} workers: {self.skipped[workers]}; valid "
                                    f"sizes are {self.valid_sizes()}")

    def config_for(self, config: dict[str, Any] | None, workers: int) -> dict[str, Any] | None:
        """The workers' DeepSpeed config at `workers` ranks: the batch keys set to this size's split."""
        if config is None or self.train_batch_size is None or workers not in self.splits:
            return config
        split = self.splits[workers]
        out = dict(config)
        out.pop("elasticity", None)  # honoured here; the engine sees plain batch keys
        out.update(train_batch_size=self.train_batch_size, train_micro_batch_size_per_gpu=split.micro_batch,
                   gradient_accumulation_steps=split.gradient_accumulation_steps)
        return out


def _int_key(config: dict[str, Any], key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def plan_batches(config: dict[str, Any] | None, min_workers: int, max_workers: int) -> BatchPlan:
    """The batch plan of a run whose DeepSpeed config is `config` ([Note: elastic batch]); a world
    size the stage-3 layout's groups do not divide is skipped too ([Note: stage-3 layouts])."""
    plan = _plan_batches(config, min_workers, max_workers)
    multiple, keys = raw_world_multiple(config)
    for size in range(min_workers, max_workers + 1):
        if size % multiple and size not in plan.skipped:
            plan.splits.pop(size, None)
            plan.skipped[size] = f"{keys} groups {multiple} consecutive ranks, which {size} workers cannot split into"
    return plan


def _plan_batches(config: dict[str, Any] | None, min_workers: int, max_workers: int) -> BatchPlan:
    config = config or {}
    elasticity = config.get("elasticity") or {}
    if elasticity.get("enabled"):
        return _plan_from_elasticity(config, elasticity, min_workers, max_workers)
    micro = _int_key(config, "train_micro_batch_size_per_gpu")
    gas = _int_key(config, "gradient_accumulation_steps")
    total = _int_key(config, "train_batch_size")
    if total is None and micro is not None:
        total = micro * (gas or 1) * max_workers
    if total is None:
        return BatchPlan(min_workers, max_workers, None)
    splits, skipped = {}, {}
    for size in range(min_workers, max_workers + 1):
        if micro is not None:
            if total % (micro * size):
                skipped[size] = (f"train_batch_size={total} is not a multiple of micro batch {micro} x "
                                 f"{size} workers")
                continue
            splits[size] = BatchSplit(size, micro, total // (micro * size))
        else:
            accumulate = gas or 1
            if total % (accumulate * size):
                skipped[size] = (f"train_batch_size={total} is not a multiple of gradient_accumulation_steps="
                                 f"{accumulate} x {size} workers")
                continue
            splits[size] = BatchSplit(size, total // (accumulate * size), accumulate)
    return BatchPlan(min_workers, max_workers, total, splits, skipped)


def _plan_from_elasticity(config: dict[str, Any], elasticity: dict[str, Any], min_workers: int,
                          max_workers: int) -> BatchPlan:
    version = float(elasticity.get("version", 0.2))
    per_node = int(elasticity.get("num_gpus_per_node", 1))
    model_parallel = int(elasticity.get("model_parallel_size", 1))
    if version > 0.1 and (per_node != 1 or model_parallel != 1):
        raise RayZeroValueError(
            f"elasticity version {version} with num_gpus_per_node={per_node}, model_parallel_size="
            f"{model_parallel}: rayzero implements the per-rank algorithm only (one rank per node, no model "
            "parallelism); set both to 1 or version to 0.1")
    has_batch = any(key in config for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                              "gradient_accumulation_steps"))
    if has_batch and not elasticity.get("ignore_non_elastic_batch_info", False):
        raise RayZeroValueError(  # DeepSpeed's ElasticityConfigError says the same
            "the config sets batch keys (train_batch_size / train_micro_batch_size_per_gpu / "
            "gradient_accumulation_steps) and elasticity.enabled; the elasticity block decides the batch: "
            "remove them or set elasticity.ignore_non_elastic_batch_info=true")
    micro_batches = [int(m) for m in elasticity.get("micro_batch_sizes", [2, 4, 6])]
    # DeepSpeed's own range decides the batch (so it equals DeepSpeed's); the run's range then
    # picks the sizes it may use.
    min_gpus = int(elasticity.get("min_gpus", 1))
    max_gpus = int(elasticity.get("max_gpus", 10_000))
    total, sizes = deepspeed_elastic_batch(micro_batches, int(elasticity.get("max_train_batch_size", 2000)),
                                           min_gpus, max_gpus, bool(elasticity.get("prefer_larger_batch", True)))
    splits, skipped = {}, {}
    for size in range(min_workers, max_workers + 1):
        if size not in sizes:
            skipped[size] = f"the elasticity block's global batch {total} has no valid split over {size} workers"
            continue
        micro = next(m for m in sorted(set(micro_batches), reverse=True) if (total // size) % m == 0)
        splits[size] = BatchSplit(size, micro, total // size // micro)
    return BatchPlan(min_workers, max_workers, total, splits, skipped)
