"""A full disk on some ranks only ([Note: a save that fails on storage]), on real gloo groups and a
real small filesystem: the ranks that could write do not wait forever for the ones that could not,
every rank reports the same failure, nothing is committed anywhere, `latest` stays, and the next
save commits once there is room. Shared storage (one rank's shard does not fit) and node-local
storage (a peer replica does not fit on the receiving node) in one spawned group."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from testkit.harness import spawn
from testkit.small_disk import SmallDisk

from rayzero.checkpoint.checkpointer import Checkpointer
from rayzero.checkpoint.manifest import committed_tags, read_latest
from rayzero.checkpoint.options import CheckpointOptions
from rayzero.checkpoint.types import ShardedTensor, ShardSpec
from rayzero.config.environment import NODE_ID, NODE_LOCAL_DIR

SMALL, BIG = 1024, 1 << 20  # elements: 4 KiB and 4 MiB (the disk has 16 MiB, filled to 1 MiB free)


def _shards(rank: int, value: float, big_rank: int) -> list[ShardedTensor]:
    numel = BIG if rank == big_rank else SMALL
    return [ShardedTensor(ShardSpec(f"module/w{rank}", (numel,), torch.float32, 0, numel), torch.full((numel,), value))]


def _attempt(checkpointer: Checkpointer, root: str | None, step: int, rank: int, big_rank: int) -> dict:
    checkpointer.save(root, f"global_step{step}", step, 1, _shards(rank, float(step), big_rank))
    checkpointer.saver.join()
    failure = checkpointer.last_save_failure
    return {"failed": failure is not None and failure.tag == f"global_step{step}",
            "problems": [(p.rank, os.path.basename(p.path)) for p in failure.problems] if failure else []}


def _fill_save_release(checkpointer: Checkpointer, root: str | None, listed: str, rank: int, big_rank: int,
                       disk: SmallDisk, prefix: str) -> dict:
    """Save with room, save with the disk full (the big piece cannot fit), save with room again."""
    results = {f"{prefix}first": _attempt(checkpointer, root, 1, rank, big_rank=-1)}
    if rank == 0:
        disk.fill(leave_bytes=1 << 20)
    dist.barrier()
    results[f"{prefix}full"] = _attempt(checkpointer, root, 2, rank, big_rank=big_rank)
    results[f"{prefix}latest"] = read_latest(listed)
    results[f"{prefix}tags"] = [tag for _, tag in committed_tags(listed)]
    dist.barrier()
    if rank == 0:
        disk.release()
    dist.barrier()
    results[f"{prefix}again"] = _attempt(checkpointer, root, 3, rank, big_rank=big_rank)
    checkpointer.wait()
    return results


def _cases(rank: int, world: int, payload: dict) -> dict:
    disk = SmallDisk(payload["small"], payload["kind"])
    # 1. shared storage on the small disk: rank 1's shard does not fit, rank 0's does
    shared = str(disk.path / "shared")
    results = _fill_save_release(Checkpointer(CheckpointOptions(keep_last=3, timeout_s=60)), shared, shared, rank,
                                 1, disk, "shared_")
    # 2. node-local storage: node a (rank 0) on the big disk, node b (rank 1) on the small one;
    #    rank 0's big shard is replicated to node b, where it does not fit
    os.environ[NODE_ID.name] = f"node-{'ab'[rank]}"
    os.environ[NODE_LOCAL_DIR.name] = payload["big"] if rank == 0 else str(disk.path / "node-b")
    local = Checkpointer(CheckpointOptions(node_local=True, replicas=1, keep_last=3, timeout_s=60))
    results.update(_fill_save_release(local, None, os.path.join(os.environ[NODE_LOCAL_DIR.name], "checkpoints"), rank,
                                      0, disk, "local_"))
    return results


def test_a_disk_full_on_one_rank_fails_the_save_everywhere_and_the_next_one_commits(small_disk, tmp_path):
    results = spawn(2, _cases, {"small": str(small_disk.path), "kind": small_disk.kind, "big": str(tmp_path / "node-a")},
                    timeout_s=240)
    for rank, result in enumerate(results):
        assert not result["shared_first"]["failed"] and not result["local_first"]["failed"], (rank, result)
        # shared: rank 1's shard did not fit; both ranks know, nothing of step 2 is committed
        # (rank 0's small shard may lose the race for the last free bytes to rank 1's partial write:
        # then it is named too, and still nothing is committed)
        shared_full = result["shared_full"]
        assert shared_full["failed"] and (1, "rank00001.safetensors") in shared_full["problems"], result
        assert set(shared_full["problems"]) <= {(0, "rank00000.safetensors"), (1, "rank00001.safetensors")}, result
        # node-local: the replica of rank 0's shard did not fit on node b; neither node committed
        local_full = result["local_full"]
        assert local_full["failed"] and (1, "rank00000.safetensors") in local_full["problems"], result
        assert all(problem_rank == 1 for problem_rank, _ in local_full["problems"]), result  # node a had room
        for prefix in ("shared_", "local_"):
            assert result[f"{prefix}latest"] == "global_step1" and result[f"{prefix}tags"] == ["global_step1"]
            assert not result[f"{prefix}again"]["failed"], (prefix, result)
    assert [tag for _, tag in committed_tags(str(small_disk.path / "shared"))] == ["global_step3", "global_step1"]
    assert not os.path.exists(small_disk.path / "shared" / "global_step2")
