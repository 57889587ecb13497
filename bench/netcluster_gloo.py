"""Plain gloo collectives on an emulated cluster (bench/netcluster.py): how fast its links are, and
how many bytes each collective puts on them, measured with no rayzero and no Ray in the way.

`measure(cluster, ranks_per_node, megabytes)` starts one process per rank inside its node's
namespace (`ip netns exec`, GLOO_SOCKET_IFNAME=emu), forms one gloo group, and times each
collective of a `megabytes` fp32 tensor; rank 0 reads the link counters (`tc -s`) after a barrier
before and after each, so every row also says how many bytes crossed between nodes. Those figures
are the oracle the multi-node test and bench hold the engine's traffic to: how much of a
collective's volume crosses the link depends on gloo's algorithm and on where the ranks sit, not on
rayzero.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.netcluster import IFNAME, NetCluster, counter_delta

REPO = Path(__file__).resolve().parent.parent
OPS = ("broadcast", "all_reduce", "all_gather", "reduce_scatter")


def measure(cluster: NetCluster, ranks_per_node: list[int], megabytes: float = 32.0, repeats: int = 3,
            ops: tuple[str, ...] = OPS, timeout_s: float = 300.0) -> dict:
    """One gloo group with `ranks_per_node[i]` ranks on node i (ranks contiguous per node); per op,
    the median seconds, Gbit/s of the tensor's bytes per second and the link bytes per call."""
    world = sum(ranks_per_node)
    placement = [node for node, count in enumerate(ranks_per_node) for _ in range(count)]
    master = cluster.address(placement[0])
    env = {**os.environ, "GLOO_SOCKET_IFNAME": IFNAME, "MASTER_ADDR": master, "MASTER_PORT": "29511",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "bench.netcluster_gloo", "--world", str(world), "--megabytes", str(megabytes),
            "--repeats", str(repeats), "--ops", ",".join(ops), "--cluster", json.dumps(cluster.describe())]
    processes = [subprocess.Popen(cluster.exec_argv(node, [*argv, "--rank", str(rank)]), env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank, node in enumerate(placement)]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=timeout_s))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    failed = [(rank, p.returncode, err[-2000:]) for rank, (p, (_, err)) in enumerate(zip(processes, outputs))
              if p.returncode != 0]
    if failed:
        raise RuntimeError(f"gloo ranks failed: {failed}")
    result = json.loads(outputs[0][0].strip().splitlines()[-1])
    result["ranks_per_node"] = list(ranks_per_node)
    return result


def _rank(args: argparse.Namespace) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=120))
    cluster = NetCluster.from_description(json.loads(args.cluster))
    elements = int(args.megabytes * 2**20 / 4)
    elements -= elements % args.world
    tensor = torch.ones(elements)
    shard = torch.ones(elements // args.world)

    def run(op: str, root: int = 0) -> None:
        if op == "broadcast":
            dist.broadcast(tensor, src=root)
        elif op == "all_reduce":
            dist.all_reduce(tensor)
        elif op == "all_gather":
            dist.all_gather_into_tensor(tensor, shard)
        elif op == "reduce_scatter":
            dist.reduce_scatter_tensor(shard, tensor)

    rows = {}
    cases = [(op, root) for op in args.ops.split(",") for root in (range(args.world) if op == "broadcast" else [0])]
    for op, root in cases:
        run(op, root)  # connections made, buffers allocated
        times, crossed = [], []
        for _ in range(args.repeats):
            dist.barrier()
            before = cluster.link_counters() if args.rank == 0 else None
            dist.barrier()
            started = time.perf_counter()
            run(op, root)
            dist.barrier()
            times.append(time.perf_counter() - started)
            if args.rank == 0:
                crossed.append(counter_delta(cluster.link_counters(), before)["total"]["up_bytes"])
        if args.rank == 0:
            seconds = statistics.median(times)
            rows[f"{op}_root{root}" if op == "broadcast" else op] = {
                "seconds_median": seconds, "seconds": times,
                "tensor_gbit_per_s": elements * 4 * 8 / seconds / 1e9,
                "link_bytes_per_call": statistics.median(crossed),
                "link_bytes_per_tensor_byte": statistics.median(crossed) / (elements * 4)}
    if args.rank == 0:
        print(json.dumps({"world": args.world, "tensor_bytes": elements * 4, "ops": rows}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--megabytes", type=float, default=32.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--cluster", required=True, help="NetCluster.describe() as JSON")
    _rank(parser.parse_args())


if __name__ == "__main__":
    main()
