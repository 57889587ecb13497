"""Pure partition math: buckets of parameters laid out in flat buffers, padding, shard ranges.

No torch.distributed here, no tensors: every function maps sizes to ranges, so it is unit-tested
without a process group (tests/unit/test_partition.py).

[Note: bucket partitioning]
Trainable parameters are laid out, in backward order (reverse registration order), into *buckets*
of at most `reduce_bucket_size` elements (a larger parameter gets a bucket to itself). Each bucket
is one flat buffer padded to a multiple of the world size, and rank r owns the r-th equal slice of
*every* bucket. Why per bucket rather than one flat buffer cut into N pieces (DeepSpeed's layout):
  - a bucket's reduce-scatter and all-gather are then single equal-split collectives
    (`reduce_scatter_single` / `all_gather_single`) with no per-rank fix-up, on gloo and NCCL;
  - a parameter never spans two buckets, so the piece of a parameter a rank owns is one contiguous
    flat range of that parameter — exactly the `[Note: flat-range partitioning]` unit the checkpoint
    layer stores (rayzero/checkpoint/types.py);
  - padding is at most world_size - 1 elements per bucket, never stored in checkpoints.
A rank's fp32 master shard for one optimizer parameter group is the concatenation of its slices of
that group's buckets, in bucket order (`GroupLayout.shard_offsets`).
"""
from __future__ import annotations

from dataclasses import dataclass

from rayzero.config.errors import RayZeroValueError


def padded_size(numel: int, world_size: int) -> int:
    """Smallest multiple of `world_size` that holds `numel` elements."""
    if world_size < 1:
        raise RayZeroValueError(f"world_size={world_size} must be at least 1")
    return -(-numel // world_size) * world_size


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter sits inside its bucket's flat buffer."""

    index: int
    """Position of the parameter in the list given to `plan_buckets` (its param group's order)."""
    numel: int
    offset: int
    """First element of the parameter inside the bucket's flat buffer."""

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class ParamPiece:
    """The part of one parameter a rank owns (possibly empty)."""

    param_start: int
    """First owned element, in the parameter's own flattened coordinates."""
    param_end: int
    shard_offset: int
    """Where that piece starts inside the rank's slice of the bucket."""

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class BucketLayout:
    """One flat buffer of whole parameters, padded so it splits evenly across ranks."""

    slots: tuple[ParamSlot, ...]
    world_size: int

    @property
    def numel(self) -> int:
        """Elements of real parameters (no padding)."""
        return self.slots[-1].end if self.slots else 0

    @property
    def padded_numel(self) -> int:
        return padded_size(self.numel, self.world_size)

    @property
    def shard_numel(self) -> int:
        """Elements of this bucket each rank owns (padding included)."""
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's slice inside the bucket's flat buffer."""
        if not 0 <= rank < self.world_size:
            raise RayZeroValueError(f"rank={rank} outside world of size {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def piece(self, slot: ParamSlot, rank: int) -> ParamPiece:
        """The elements of `slot`'s parameter that `rank` owns (numel 0 when none)."""
        start, end = self.shard_range(rank)
        lo, hi = max(start, slot.offset), min(end, slot.end)
        if lo >= hi:
            return ParamPiece(0, 0, 0)
        return ParamPiece(lo - slot.offset, hi - slot.offset, lo - start)


@dataclass(frozen=True)
class GroupLayout:
    """The buckets of one optimizer parameter group and where each sits in a rank's master shard."""

    buckets: tuple[BucketLayout, ...]

    @property
    def shard_numel(self) -> int:
        """Length of one rank's master shard for this group (sum of its bucket slices)."""
        return sum(bucket.shard_numel for bucket in self.buckets)

    @property
    def shard_offsets(self) -> tuple[int, ...]:
        """Offset of each bucket's slice inside the rank's master shard."""
        offsets, running = [], 0
        for bucket in self.buckets:
            offsets.append(running)
            running += bucket.shard_numel
        return tuple(offsets)

    @property
    def numel(self) -> int:
        return sum(bucket.numel for bucket in self.buckets)

    @property
    def padded_numel(self) -> int:
        return sum(bucket.padded_numel for bucket in self.buckets)


def plan_buckets(numels: list[int], bucket_size: int, world_size: int,
                 first_bucket_size: int | None = None) -> GroupLayout:
    """Group parameters (given in the order they should be reduced) into buckets.

    A bucket closes when adding the next parameter would exceed `bucket_size` elements (the first
    bucket: `first_bucket_size`, when smaller); a parameter larger than that gets a bucket of its
    own. Zero-element parameters are skipped: they have nothing to reduce and would make an empty
    collective.
    """
    if bucket_size < 1:
        raise RayZeroValueError(
            f"zero_optimization.reduce_bucket_size={bucket_size} must be a positive element count")
    buckets: list[BucketLayout] = []
    current: list[ParamSlot] = []
    filled = 0
    for index, numel in enumerate(numels):
        if numel == 0:
            continue
        limit = min(bucket_size, first_bucket_size) if first_bucket_size and not buckets else bucket_size
        if current and filled + numel > limit:
            buckets.append(BucketLayout(tuple(current), world_size))
            current, filled = [], 0
        current.append(ParamSlot(index, numel, filled))
        filled += numel
    if current:
        buckets.append(BucketLayout(tuple(current), world_size))
    return GroupLayout(tuple(buckets))


def split_evenly(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's piece when `numel` elements (padded to a multiple) split N ways,
    clipped to the real elements — the stage-3 per-parameter layout."""
    shard = padded_size(numel, world_size) // world_size
    start = min(rank * shard, numel)
    return start, min(start + shard, numel)
