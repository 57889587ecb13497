"""The data position: which samples the run has consumed, valid at any world size.

[Note: data position]
The position is one number, `consumed_samples` = optimizer steps x global batch size. It reshards
because a global batch is a *contiguous* run of the epoch's sample order, whatever the world size:
rank r of W takes order[start + r :: W], so micro batch j of every rank together covers positions
[j*b*W, (j+1)*b*W) and one optimizer step (gas micro batches) covers [k*G, (k+1)*G) with
G = b * W * gas. Resuming at W' with the same G (rayzero keeps G by changing gas) therefore feeds
each step exactly the samples the uninterrupted run would have, split differently across ranks.
Epochs hold a whole number of global batches (the tail shorter than G is dropped, as with
drop_last), so the epoch of a position does not depend on W either. torch's DistributedSampler
cannot resume mid-epoch at all, and DCP does not reshard the data position (torchtitan#811).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from rayzero.config.errors import RayZeroValueError


class ResumableSampler(torch.utils.data.Sampler[int]):
    """A distributed sampler whose position is a global sample count (see [Note: data position])."""

    def __init__(self, dataset_size: int, global_batch_size: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, seed: int = 0) -> None:
        if global_batch_size < 1 or global_batch_size % world_size:
            raise RayZeroValueError(f"global batch size {global_batch_size} must be a positive multiple of the world "
                             f"size {world_size} (train_batch_size = micro batch x gas x world)")
        if dataset_size < global_batch_size:
            raise RayZeroValueError(f"the dataset has {dataset_size} samples, fewer than one global batch "
                             f"({global_batch_size}); lower train_batch_size or add data")
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.samples_per_epoch = dataset_size // global_batch_size * global_batch_size
        self.epoch = 0
        self.offset = 0  # global samples of `epoch` already consumed

    def set_epoch(self, epoch: int) -> None:
        """As DistributedSampler.set_epoch; keeps a resumed mid-epoch offset for that same epoch."""
        if epoch != self.epoch:
            self.epoch, self.offset = epoch, 0

    def set_position(self, consumed_samples: int) -> None:
        """Continue after `consumed_samples` global samples (from a checkpoint)."""
        self.epoch, self.offset = divmod(int(consumed_samples), self.samples_per_epoch)

    def position(self, optimizer_steps: int) -> int:
        return optimizer_steps * self.global_batch_size

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.dataset_size)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator)

    def __iter__(self) -> Iterator[int]:
        order = self._order()[self.offset:self.samples_per_epoch]
        return iter(order[self.rank::self.world_size].tolist())

    def __len__(self) -> int:
        return (self.samples_per_epoch - self.offset) // self.world_size
