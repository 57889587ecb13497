"""Bytes a checkpoint load exchanges to learn which files each location holds, at N ranks (issue 35
item 4): before and after [Note: one inventory per location] and [Note: gathering uneven objects]
(rayzero/checkpoint/loader.py, comm.py). Prints JSON.

    python bench/scale_loader.py [--sizes 2,4,...,4096] [--checkpoints 3]

A model, not a run: each rank's payload is the object the loader sends, built for the layout and
pickled as the gather pickles it; what every rank then receives is torch's padded all-gather for
the old code (world size - 1 slots of the largest payload) and `comm.gather_cost` for the new one;
both after the all-gather of the sizes (8 bytes a rank). "Per load" is every rank's bytes together.
bench/scale.py's checkpoint section calls `inventory_bytes` for its N.

Before: each location's leader sent {tag: (step, created, {file: size})} for every committed
checkpoint. After: the leaders send {tag: (step, created)}, then the leaders holding the checkpoint
tried (the newest, usually the only one) its present files' names.
"""
from __future__ import annotations

import argparse
import json
import math
import pickle
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayzero.checkpoint.comm import Topology, gather_cost
from rayzero.checkpoint.manifest import shard_file_name

SIZES = tuple(2 ** power for power in range(1, 13))  # 2 ... 4096
LAYOUTS = {  # name -> (ranks per node, node-local, replicas)
    "shared storage, 8 ranks a node": (8, False, 0),
    "node-local, 8 ranks a node, 1 replica": (8, True, 1),
    "node-local, 1 rank a node, 1 replica": (1, True, 1),
}
FILE_BYTES = 1_500_000_000  # a shard file's size (pickled as an int of its own width)
FIRST_STEP, CREATED = 100_000, 1_790_000_000.123


def _pickled(value: Any) -> int:
    return len(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


def _files_by_leader(world_size: int, ranks_per_node: int, node_local: bool, replicas: int) -> dict[int, list[str]]:
    """Each location's shard files of one checkpoint (its ranks' own and the replicas it keeps), by
    the location's leader (the rank that lists them)."""
    topology = Topology.from_nodes([f"node{rank // ranks_per_node:05d}" for rank in range(world_size)], node_local)
    files: dict[str, list[str]] = {location: [] for location in topology.ordered_locations}
    for rank in range(world_size):
        files[topology.locations[rank]].append(shard_file_name(rank))
        for target in (topology.replica_targets(rank, replicas) if node_local else []):
            files[topology.locations[target]].append(shard_file_name(rank))
    return {topology.leader(location): names for location, names in files.items()}


def _gather_bytes_before(sizes: list[int]) -> int:
    """torch's all_gather_object: every payload padded to the largest (after the sizes' all-gather)."""
    return 8 * (len(sizes) - 1) + (len(sizes) - 1) * max(sizes)


def _gather_bytes_after(sizes: list[int]) -> int:
    return 8 * (len(sizes) - 1) + gather_cost(sizes)[1]


def inventory_bytes(world_size: int, ranks_per_node: int = 8, node_local: bool = True, replicas: int = 1,
                    checkpoints: int = 3) -> dict[str, int]:
    """Bytes each rank receives, and the load's total, for the inventory of `checkpoints` committed
    checkpoints (keep_last's default 3), before and after the change."""
    by_leader = _files_by_leader(world_size, ranks_per_node, node_local, replicas)
    tags = [f"global_step{FIRST_STEP + index}" for index in range(checkpoints)]
    listings = list(by_leader.values())
    empty_dict, nothing = _pickled({}), _pickled(None)

    def spread(sent: list[int], idle: int) -> list[int]:  # the leaders' payloads, the others' idle one
        sizes = [idle] * world_size
        for rank, size in zip(by_leader, sent):
            sizes[rank] = size
        return sizes

    before = _gather_bytes_before(spread(
        [_pickled({tag: (FIRST_STEP, CREATED, dict.fromkeys(files, FILE_BYTES)) for tag in tags})
         for files in listings], empty_dict))
    after = (_gather_bytes_after(spread([_pickled({tag: (FIRST_STEP, CREATED) for tag in tags})
                                         for _ in listings], empty_dict))
             + _gather_bytes_after(spread([_pickled(sorted(files)) for files in listings], nothing)))
    return {"load_inventory_per_rank_bytes_before": before, "load_inventory_per_rank_bytes": after,
            "load_inventory_per_load_bytes_before": before * world_size,
            "load_inventory_per_load_bytes": after * world_size}


def _exponent(sizes: list[int], values: list[int]) -> float:
    """Least-squares slope of log(value) on log(N) (bench/scale.py's `exponent`)."""
    xs, ys = [math.log(n) for n in sizes], [math.log(v) for v in values]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    return (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
            / sum((x - mean_x) ** 2 for x in xs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--checkpoints", type=int, default=3, help="committed checkpoints (keep_last)")
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    layouts = {}
    for name, (ranks_per_node, node_local, replicas) in LAYOUTS.items():
        rows = [{"n": n, **inventory_bytes(n, ranks_per_node, node_local, replicas, args.checkpoints)}
                for n in sizes]
        for row in rows:
            row["ratio_per_rank"] = round(row["load_inventory_per_rank_bytes_before"]
                                          / row["load_inventory_per_rank_bytes"], 2)
        fitted = [row for row in rows if row["n"] >= 64] or rows  # the tail, past the fixed costs
        sizes_fitted = [row["n"] for row in fitted]
        layouts[name] = {
            "rows": rows,
            "exponent_per_rank_before": round(_exponent(
                sizes_fitted, [row["load_inventory_per_rank_bytes_before"] for row in fitted]), 2),
            "exponent_per_rank": round(_exponent(sizes_fitted, [row["load_inventory_per_rank_bytes"] for row in fitted]), 2),
        }
    print(json.dumps({"benchmark": "scale_loader", "checkpoints": args.checkpoints, "layouts": layouts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
