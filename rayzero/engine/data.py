"""The training data loader `rayzero.initialize(training_data=...)` returns (DeepSpeed's)."""
from __future__ import annotations

from typing import Any

import torch

from rayzero.checkpoint.data_position import ResumableSampler
from rayzero.config.errors import RayZeroValueError
from rayzero.engine.comm import Communicator


def build_dataloader(training_data: Any, micro_batch_size: int | None, global_batch_size: int | None,
                     comm: Communicator, collate_fn: Any = None) -> torch.utils.data.DataLoader | None:
    """A loader giving each rank its share of `training_data` in micro batches (DeepSpeed's).

    Its sampler is a `ResumableSampler`, not torch's DistributedSampler: the same interleaved
    split, but its position is a global sample count, so `load_checkpoint` resumes it mid-epoch at
    any world size ([Note: data position]). Shuffled with seed 0 like DistributedSampler; call
    `loader.sampler.set_epoch(epoch)` per epoch, starting from `loader.sampler.epoch` after a resume.
    """
    if training_data is None:
        return None
    if micro_batch_size is None or global_batch_size is None:
        raise RayZeroValueError("training_data was given but train_micro_batch_size_per_gpu is not set: set it "
                         "(or train_batch_size and gradient_accumulation_steps) in the config")
    sampler = ResumableSampler(len(training_data), global_batch_size=global_batch_size, rank=comm.rank,
                               world_size=comm.world_size, shuffle=True, seed=0)
    return torch.utils.data.DataLoader(training_data, batch_size=micro_batch_size, sampler=sampler,
                                       collate_fn=collate_fn)
