"""A corrupt peer copy is dropped and another copy fetched (found by bench/chaos.py's `corrupt` fault):
three nodes with node-local checkpoints replicated to both peers; node c lost its disk, so rank 2's
shard of the newest checkpoint must come from a peer; node a's copy, the first the plan picks, has a
flipped byte. The load must fetch node b's copy and load the newest checkpoint, not fall back to
an older one. Real gloo group of three ranks, real files."""
from __future__ import annotations

import os
import shutil
import warnings

import torch.distributed as dist
from test_checkpoint_reshard import _assert_reads, run_group, shards_for, specs_for

from rayzero.checkpoint.checkpointer import Checkpointer
from rayzero.checkpoint.options import CheckpointOptions
from rayzero.config.environment import NODE_ID, NODE_LOCAL_DIR


def _flip_a_byte(path: str) -> None:
    with open(path, "r+b") as handle:
        handle.seek(os.path.getsize(path) - 20)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))


def _body(rank: int, world: int, base: str) -> None:
    node = "abc"[rank]
    os.environ[NODE_ID.name] = f"node-{node}"
    os.environ[NODE_LOCAL_DIR.name] = os.path.join(base, f"node-{node}")
    saver = Checkpointer(CheckpointOptions(node_local=True, replicas=2, keep_last=3, async_save=False))
    for step in (10, 20):
        saver.save(None, f"global_step{step}", step, 2, shards_for(rank, world, step))
    saver.wait()
    directory = os.path.join(os.environ[NODE_LOCAL_DIR.name], "checkpoints")
    dist.barrier()
    copy_on_a = os.path.join(base, "node-a", "checkpoints", "global_step20", "rank00002.safetensors")
    copy_on_b = os.path.join(base, "node-b", "checkpoints", "global_step20", "rank00002.safetensors")
    assert os.path.isfile(copy_on_a) and os.path.isfile(copy_on_b)  # replicated to both peers
    if rank == 0:
        _flip_a_byte(copy_on_a)
    if rank == 2:
        shutil.rmtree(directory)  # node c comes back with an empty disk
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = Checkpointer(CheckpointOptions(node_local=True, replicas=2)).load(None, specs_for(rank, world))
    assert loaded.manifest.step == 20, f"rank {rank} fell back to step {loaded.manifest.step}"
    assert loaded.source == "peer"
    _assert_reads(loaded, rank, world, 20, True)
    messages = [str(warning.message) for warning in caught]
    assert not any("instead of the newer" in message for message in messages), messages
    if rank == 0:
        assert any("corrupt shard copies" in message for message in messages), messages
        assert os.path.isfile(copy_on_a + ".corrupt")  # set aside, never picked again


def test_a_corrupt_peer_copy_is_dropped_and_another_peer_s_copy_is_loaded(tmp_path):
    run_group(3, _body, str(tmp_path))
