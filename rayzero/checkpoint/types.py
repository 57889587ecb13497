"""The contract between the engine and the checkpoint layer.

[Note: flat-range partitioning]
Every piece of training state the engine holds is described as a *flat range* of one named global
tensor: the global tensor is flattened (row-major), and this rank holds the elements
[flat_start, flat_end). This one description covers every stage:
  - a replicated tensor (stage 0 parameters, stage 1/2 bf16 copies, RNG, buffers) is the full
    range [0, numel) held by every rank (the writer stores it once, from the lowest rank holding it);
  - a ZeRO-partitioned tensor (fp32 master weights, Adam moments, stage-3 parameter shards) is one
    contiguous slice per rank; padding added by the engine to make numel divisible by the world size
    is never part of a range.
Because the manifest records global shapes and every range, a checkpoint written at world size N
and stage S can be read at any world size M and stage T: the reader assembles any requested range
from whichever shard files overlap it. No offline conversion.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """Where one rank's piece sits inside one named global tensor."""

    name: str
    """Unique key, e.g. `module/layers.0.weight` or `optimizer/exp_avg/layers.0.weight`."""
    global_shape: tuple[int, ...]
    """Shape of the full (unpartitioned) tensor."""
    dtype: torch.dtype
    """dtype the tensor is stored in."""
    flat_start: int
    """First element of this rank's piece in the flattened global tensor."""
    flat_end: int
    """One past the last element; flat_end - flat_start == local numel."""

    @property
    def global_numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def is_full(self) -> bool:
        return self.flat_start == 0 and self.flat_end == self.global_numel


class LazyPiece:
    """A rank's piece that is not in memory (NVMe-offloaded optimizer state): the shard file writer
    reads it with `materialize()` just before writing it and drops it right after, so a save holds
    one piece at a time, never the whole state ([Note: streamed save])."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self._numel, self.dtype = numel, dtype

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return self.dtype.itemsize

    def materialize(self) -> torch.Tensor:
        """The piece as a 1-D CPU tensor (fresh memory the caller may drop)."""
        raise NotImplementedError


@dataclass
class ShardedTensor:
    """A rank's piece of a global tensor: `local` is 1-D with flat_end - flat_start elements (or a
    LazyPiece read only when written)."""

    spec: ShardSpec
    local: torch.Tensor
