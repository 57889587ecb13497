"""Stages 0-2 described as flat ranges for the checkpoint layer, and loaded back from them.

Names and units follow [Note: flat-range partitioning] (rayzero/checkpoint/types.py):
  module/<name>            every parameter and buffer, full range, compute dtype (replicated)
  master/<name>            fp32 master piece of a trainable parameter this rank owns
  optim/<key>/<name>       per-element optimizer state (exp_avg, ...) for the same piece
Bucket padding is never part of a range. Scalar optimizer state (Adam's `step`) is not a tensor
shard: it travels in `engine.extra_state()` (optim_state.scalar_state).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from rayzero.checkpoint.types import ShardedTensor, ShardSpec
from rayzero.engine.optim_state import elementwise_state_keys, ensure_optimizer_state

if TYPE_CHECKING:
    from rayzero.engine.bucketed.strategy import BucketedStrategy


def _module_tensors(strategy: BucketedStrategy) -> Iterator[tuple[str, torch.Tensor]]:
    yield from strategy.module.named_parameters()
    yield from strategy.module.named_buffers()


def _pieces(strategy: BucketedStrategy) -> Iterator[tuple[str, tuple, object, torch.Tensor, int]]:
    """(name, shape, piece, the bucket master tensor, bucket index) for every owned master piece."""
    for index, bucket in enumerate(strategy.buckets):
        for slot, param in zip(bucket.layout.slots, bucket.params):
            piece = bucket.master_layout.piece(slot, strategy.master_rank)
            if piece.numel == 0:
                continue
            yield strategy.param_names[id(param)], tuple(param.shape), piece, bucket.master, index


def state_shards(strategy: BucketedStrategy) -> list[ShardedTensor]:
    out: list[ShardedTensor] = []
    for name, tensor in _module_tensors(strategy):
        spec = ShardSpec(f"module/{name}", tuple(tensor.shape), tensor.dtype, 0, tensor.numel())
        out.append(ShardedTensor(spec, tensor.detach().reshape(-1)))
    keys = elementwise_state_keys(strategy.optimizer)
    for name, shape, piece, master, _ in _pieces(strategy):
        window = slice(piece.shard_offset, piece.shard_offset + piece.numel)
        spec = ShardSpec(f"master/{name}", shape, master.dtype, piece.param_start, piece.param_end)
        out.append(ShardedTensor(spec, master.detach()[window]))
        state = strategy.optimizer.state.get(master, {})
        for key in keys:
            if key in state:
                value = state[key]
                spec = ShardSpec(f"optim/{key}/{name}", shape, value.dtype, piece.param_start, piece.param_end)
                out.append(ShardedTensor(spec, strategy.offload.checkpoint_piece(master, key, value, window)))
    return out


def load_state_shards(strategy: BucketedStrategy, read: Callable[[ShardSpec], torch.Tensor]) -> None:
    """Install module tensors, master pieces and optimizer state for this rank's current layout.

    Masters are read as fp32 when the checkpoint has them (DeepSpeed's load_from_fp32_weights);
    otherwise they are rebuilt from the module weights. Parameters are then re-published from the
    masters so compute copies and masters agree.
    """
    with torch.no_grad():
        for name, tensor in _module_tensors(strategy):
            spec = ShardSpec(f"module/{name}", tuple(tensor.shape), tensor.dtype, 0, tensor.numel())
            tensor.copy_(read(spec).reshape(tensor.shape))
        ensure_optimizer_state(strategy.optimizer)
        keys = elementwise_state_keys(strategy.optimizer)
        params = dict(strategy.module.named_parameters())
        for name, shape, piece, master, _ in _pieces(strategy):
            window = slice(piece.shard_offset, piece.shard_offset + piece.numel)
            spec = ShardSpec(f"master/{name}", shape, torch.float32, piece.param_start, piece.param_end)
            try:
                value = read(spec)
            except KeyError:
                value = params[name].detach().reshape(-1)[piece.param_start:piece.param_end]
            master[window].copy_(value.reshape(-1))
            state = strategy.optimizer.state[master]
            for key in keys:
                target = state[key]
                spec = ShardSpec(f"optim/{key}/{name}", shape, target.dtype, piece.param_start,
                                 piece.param_end)
                target[window].copy_(read(spec).reshape(-1))
        strategy._publish()
