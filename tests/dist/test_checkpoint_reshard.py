"""Checkpoint layer on real gloo groups with synthetic state: write at N ranks, read at M.

No engine here: each rank builds its flat ranges of a few global tensors ([Note: flat-range
partitioning]) exactly as a ZeRO stage would, so the layer is tested on its own. One spawned group
per world size runs every case for that size.
"""
from __future__ import annotations

import os
import warnings
import zlib

import torch
from testkit.harness import spawn

from rayzero.checkpoint.checkpointer import Checkpointer
from rayzero.checkpoint.manifest import committed_tags, read_latest
from rayzero.checkpoint.options import CheckpointOptions
from rayzero.checkpoint.types import ShardedTensor, ShardSpec

# name -> (shape, dtype, partitioned?)
TENSORS = {
    "module/embed.weight": ((7, 5), torch.bfloat16, False),
    "module/head.weight": ((3, 11), torch.float32, False),
    "master/embed.weight": ((7, 5), torch.float32, True),
    "master/head.weight": ((3, 11), torch.float32, True),
    "optim/exp_avg/head.weight": ((3, 11), torch.float32, True),
    "optim/step/head.weight": ((1,), torch.int64, False),
}


def full_tensor(name: str, step: int) -> torch.Tensor:
    shape, dtype, _ = TENSORS[name]
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * step)
    return torch.randn(shape, generator=generator).mul(100).to(dtype)


def flat_range(numel: int, rank: int, world: int) -> tuple[int, int]:
    # ZeRO-style: pad to a multiple of world, padding never part of a range
    chunk = -(-numel // world)
    return min(rank * chunk, numel), min((rank + 1) * chunk, numel)


def specs_for(rank: int, world: int, stage_partitions: bool = True) -> list[ShardSpec]:
    specs = []
    for name, (shape, dtype, partitioned) in TENSORS.items():
        numel = torch.Size(shape).numel()
        start, end = flat_range(numel, rank, world) if partitioned and stage_partitions else (0, numel)
        specs.append(ShardSpec(name, tuple(shape), dtype, start, end))
    return specs


def shards_for(rank: int, world: int, step: int) -> list[ShardedTensor]:
    return [ShardedTensor(spec, full_tensor(spec.name, step).reshape(-1)[spec.flat_start:spec.flat_end].clone())
            for spec in specs_for(rank, world)]


def _run_body(rank: int, world: int, payload) -> None:
    body, args = payload
    body(rank, world, *args)


def run_group(world: int, body, *args) -> None:
    spawn(world, _run_body, (body, args))


def _assert_reads(loaded, rank: int, world: int, step: int, stage_partitions: bool) -> None:
    for spec in specs_for(rank, world, stage_partitions):
        expected = full_tensor(spec.name, step).reshape(-1)[spec.flat_start:spec.flat_end]
        assert torch.equal(loaded.read(spec), expected), (spec.name, rank, world)


def _save_body(rank: int, world: int, root: str, steps: list[int], async_save: bool) -> None:
    checkpointer = Checkpointer(CheckpointOptions(keep_last=2, async_save=async_save))
    for step in steps:
        torch.manual_seed(1000 + rank + step)
        checkpointer.save(root, f"global_step{step}", step, 2, shards_for(rank, world, step),
                          extra_state={"global_steps": step}, client_state={"epoch": step // 10})
        torch.randn(3)  # training goes on; RNG saved is the one at save time
    checkpointer.wait()


def _load_body(rank: int, world: int, root: str, step: int) -> None:
    checkpointer = Checkpointer()
    for stage_partitions in (True, False):  # ZeRO-partitioned, then everything replicated (stage 0)
        loaded = checkpointer.load(root, specs_for(rank, world, stage_partitions))
        assert loaded.manifest.step == step and loaded.manifest.extra_state == {"global_steps": step}
        assert loaded.manifest.client_state == {"epoch": step // 10}
        _assert_reads(loaded, rank, world, step, stage_partitions)
    # RNG: saved ranks get their exact stream back; extra ranks a fresh, distinct one
    torch.manual_seed(1000 + rank + step) if rank < loaded.manifest.world_size else None
    expected = torch.randn(3) if rank < loaded.manifest.world_size else None
    checkpointer.load(root, specs_for(rank, world))
    got = torch.randn(3)
    if expected is not None:
        assert torch.equal(got, expected)
    others = checkpointer.comm.all_gather_object(got)
    assert all(not torch.equal(others[rank], other) for index, other in enumerate(others) if index != rank)


def test_write_at_2_read_at_3_and_1(tmp_path):
    root = str(tmp_path / "ckpt")
    run_group(2, _save_body, root, [10, 20, 30], True)
    # retention kept the newest two, latest moved last
    assert [tag for _, tag in committed_tags(root)] == ["global_step30", "global_step20"]
    assert read_latest(root) == "global_step30"
    assert sorted(os.listdir(os.path.join(root, "global_step30"))) == sorted(
        ["manifest.json", "rayzero-owner.json"] + [f"rank{rank:05d}.safetensors" for rank in range(2)])
    run_group(3, _load_body, root, 30)
    _load_body(0, 1, root, 30)  # one process, no process group at all


def _corrupt_body(rank: int, world: int, root: str) -> None:
    checkpointer = Checkpointer(CheckpointOptions(async_save=False))
    specs = specs_for(rank, world)
    # stream into preallocated "live state" (the engine's path), poisoned first
    destinations = {spec.name: torch.full((spec.flat_end - spec.flat_start,), 7, dtype=spec.dtype) for spec in specs}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = checkpointer.load(root, specs, destinations=destinations)
    assert loaded.manifest.step == 20, "the corrupt newest checkpoint must be skipped"
    assert set(loaded.filled) == {spec.name for spec in specs}  # everything streamed into place
    _assert_reads(loaded, rank, world, 20, True)
    if rank == 0:
        assert any("corrupt" in str(warning.message) for warning in caught), [str(w.message) for w in caught]


def test_corrupt_shard_falls_back_to_previous(tmp_path):
    root = str(tmp_path / "ckpt")
    run_group(3, _save_body, root, [10, 20, 30], False)  # synchronous saves, then a 3 -> 2 reshard
    path = os.path.join(root, "global_step30", "rank00001.safetensors")
    with open(path, "r+b") as handle:  # flip one byte in the middle of the data
        handle.seek(os.path.getsize(path) - 20)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    run_group(2, _corrupt_body, root)
