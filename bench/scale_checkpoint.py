"""bench/scale.py's `checkpoint` section: the real `CheckpointSaver.save` as rank 0 of an N-rank world
(its module docstring says what is measured and how the other N-1 ranks are stood in for)."""
from __future__ import annotations

import os
import time
from typing import Any

from bench import scale_loader, scale_sim


def cpu() -> float:
    """CPU seconds of this whole process (every thread)."""
    return time.process_time()


TENSORS = ("master", "optim/exp_avg", "optim/exp_avg_sq", "module")
LAYERS = 8
PIECE = 256  # fp32 elements of each tensor per rank: 32 tensors x 1 KiB per rank file


class SimulatedWorldComm:
    """Rank 0 of an N-rank world for `CheckpointSaver`: each gather returns rank 0's value beside what
    the other ranks prepared; barriers pass (only rank 0 runs). `group` is None, so the replica plan is
    made but no bytes are sent."""

    def __init__(self, world_size: int, others: list[list[Any]]) -> None:
        self.rank, self.world_size, self.distributed, self.group = 0, world_size, True, None
        self.node_ids = [scale_sim.node_of(rank) for rank in range(world_size)]
        self._others = iter(others)  # per gather: the values of ranks 1..N-1

    def all_gather_object(self, value: Any) -> list[Any]:
        others = next(self._others, None)  # past the prepared gathers (the commit's): all agree with rank 0
        return [value] * self.world_size if others is None else [value, *others]

    def broadcast_object(self, value: Any, src: int = 0) -> Any:
        return value

    def barrier(self) -> None:
        pass


def _rank_state(world_size: int, rank: int) -> list[Any]:
    import torch

    from rayzero.checkpoint.types import ShardedTensor, ShardSpec

    return [ShardedTensor(ShardSpec(f"{kind}/layer{layer}.weight", (world_size * PIECE,), torch.float32,
                                    rank * PIECE, (rank + 1) * PIECE), torch.full((PIECE,), float(rank)))
            for kind in TENSORS for layer in range(LAYERS)]


def checkpoint_section(world_size: int, root: str) -> dict[str, Any]:
    from rayzero.checkpoint import rng
    from rayzero.checkpoint.manifest import MANIFEST, shard_file_name
    from rayzero.checkpoint.options import CheckpointOptions
    from rayzero.checkpoint.retention import claim_tag_dir, new_lineage
    from rayzero.checkpoint.saver import CheckpointSaver
    from rayzero.checkpoint.shard_file import write_shard_file
    from rayzero.controller import committed_checkpoints
    from rayzero.controller.committed_checkpoints import CheckpointTracker

    options = CheckpointOptions(node_local=True, replicas=1, keep_last=3, async_save=False)
    rng_state = rng.capture()
    out: dict[str, Any] = {}
    for step in (100, 200):  # two committed checkpoints for the registry to list
        tag = f"global_step{step}"
        # the leader claims the directory before any rank writes into it (as CheckpointSaver does)
        claim_tag_dir(os.path.join(root, tag), new_lineage())
        states = [_rank_state(world_size, rank) for rank in range(world_size)]
        started = time.perf_counter()
        written = [write_shard_file(os.path.join(root, tag, shard_file_name(rank)),
                                    [(shard.spec.name, shard.local) for shard in states[rank]], fsync=False)
                   for rank in range(1, world_size)]
        out["shard_write_s_per_file"] = (time.perf_counter() - started) / max(1, world_size - 1)
        # what the saver exchanges: each rank's payload beside its storage problems (none here)
        gathers = [[([shard.spec for shard in state], []) for state in states[1:]],
                   [((file, rng_state), []) for file in written]]
        saver = CheckpointSaver(options, SimulatedWorldComm(world_size, gathers))
        started, started_cpu = time.perf_counter(), cpu()
        saver.save(root, tag, step, 3, "digest", states[0], {"global_steps": step}, {}, asynchronous=False)
        wall, used = time.perf_counter() - started, cpu() - started_cpu
        timings = saver.wait()
        # rank 0's own shard write is not the commit's; of the two commits the least (as for CPU
        # elsewhere: the work's own cost, least disturbed by the other jobs on this shared machine)
        out.setdefault("commits_s", []).append(wall - timings.write)
        out["commit_s"] = min(out["commits_s"])
        out["save_cpu_s"] = min(used, out.get("save_cpu_s", used))  # all of rank 0's save (its 32 kB shard too)
        out["manifest_bytes"] = os.path.getsize(os.path.join(root, tag, MANIFEST))
    scans = []
    for _ in range(3):  # cold listings (a fresh cache each): wall of the first, least CPU of the three
        started, started_cpu = time.perf_counter(), cpu()
        found = committed_checkpoints.committed_in(root)
        scans.append((time.perf_counter() - started, cpu() - started_cpu))
        assert [item.record.step for item in found] == [200, 100], found
    out["registry_scan_s"] = scans[0][0]
    out["registry_scan_cpu_s"] = min(used for _, used in scans)
    tracker = CheckpointTracker((root,), node_local=False)
    started = time.perf_counter()
    tracker.refresh()  # the first listing parses each manifest once
    out["tracker_first_scan_s"] = time.perf_counter() - started
    started = time.perf_counter()
    tracker.refresh()  # what a failure costs later: the newest, then where to resume
    tracker.resume_location()
    out["tracker_failure_scans_s"] = time.perf_counter() - started
    # what a load's inventory exchange sends each rank ([Note: one inventory per location]): a model of
    # the loader's payloads (bench/scale_loader.py), for this layout and for shared storage
    out.update(scale_loader.inventory_bytes(world_size, scale_sim.RANKS_PER_NODE, options.node_local, options.replicas))
    shared = scale_loader.inventory_bytes(world_size, scale_sim.RANKS_PER_NODE, node_local=False, replicas=0)
    out.update({f"shared_{key}": value for key, value in shared.items()})
    return out
