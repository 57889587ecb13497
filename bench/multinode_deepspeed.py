"""DeepSpeed 0.19.8 on the emulated cluster (bench/netcluster.py), launched as torchrun would: one
process per rank inside its node's namespace, ranks contiguous per node, RANK / LOCAL_RANK /
WORLD_SIZE / LOCAL_WORLD_SIZE / MASTER_ADDR in the environment and GLOO_SOCKET_IFNAME=emu.
DeepSpeed picks its CPU accelerator here (no CUDA) and gloo.

`run(cluster, ranks_per_node, config, loop)` trains bench/models.py's GPT with the same torch Adam,
batches, timing and link counters as bench/multinode_loop.py and returns rank 0's figures (or the
error that stopped the ranks).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.netcluster import IFNAME, NetCluster

REPO = Path(__file__).resolve().parent.parent


def run(cluster: NetCluster, ranks_per_node: int, config: dict[str, Any], loop: dict[str, Any],
        timeout_s: float = 600.0, master_port: int = 29512) -> dict[str, Any]:
    world = cluster.nodes * ranks_per_node
    job = json.dumps({"config": config, "loop": loop, "cluster": cluster.describe()})
    base = {**os.environ, "GLOO_SOCKET_IFNAME": IFNAME, "MASTER_ADDR": cluster.address(0),
            "MASTER_PORT": str(master_port), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(ranks_per_node),
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    processes = []
    started = time.monotonic()
    for rank in range(world):
        node, local = divmod(rank, ranks_per_node)
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(local), "GROUP_RANK": str(node)}
        argv = [sys.executable, "-m", "bench.multinode_deepspeed", "--job", job]
        processes.append(subprocess.Popen(cluster.exec_argv(node, argv), env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=max(1.0, timeout_s - (time.monotonic() - started))))
    except subprocess.TimeoutExpired:
        outputs += [("", "")] * (len(processes) - len(outputs))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    wall = time.monotonic() - started
    if any(process.returncode != 0 for process in processes):
        errors = [f"rank {rank} (exit {process.returncode}): {_last_error(err)}"
                  for rank, (process, (_, err)) in enumerate(zip(processes, outputs)) if process.returncode != 0]
        return {"error": "; ".join(errors[:2])[:3000], "wall_s": wall}
    lines = [line for line in outputs[0][0].splitlines() if line.startswith("{")]
    return {**json.loads(lines[-1]), "wall_s": wall}


def _last_error(stderr: str) -> str:
    """The exception line of a traceback (the last line that names an error), else the tail."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "Exception" in line]
    return (named[-1] if named else (lines[-1] if lines else "no output")).strip()[:1500]


def _rank(job: dict[str, Any]) -> None:
    import collections
    import copy

    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    from bench.models import build_model, trainable_parameters
    from bench.multinode_loop import measure_steps

    torch.set_num_threads(1)
    counts = _count_collectives()
    # bench/engine_systems.py's reason: no native op build (only inference_all_reduce would use one)
    deepspeed.ops.__dict__.setdefault("__compatible_ops__", collections.defaultdict(bool))
    deepspeed.init_distributed(dist_backend="gloo")
    cluster = NetCluster.from_description(job["cluster"])
    loop = job["loop"]
    size, warmup, steps = loop["size"], int(loop["warmup"]), int(loop["steps"])
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model("gpt", size)
    parameters = trainable_parameters(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=job["config"])
    last_step: dict[str, dict[str, int]] = {}

    def keep_last_step() -> None:
        last_step.clear()
        last_step.update(copy.deepcopy(counts))

    measured = measure_steps(engine, cluster, size, warmup, steps, before_step=counts.clear, after_step=keep_last_step)
    if rank == 0:
        print(json.dumps({"trainable_parameters": parameters, "world_size": world, "warmup": warmup, "steps": steps,
                          **measured, "collectives_last_step": last_step}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _count_collectives() -> dict[str, dict[str, int]]:
    """Count DeepSpeed's collectives by kind and group size, in rayzero's unit (elements and bytes of
    the full tensor: [Note: communication accounting] in rayzero/engine/comm.py): wrappers around
    torch.distributed's functions, installed in this bench process before DeepSpeed binds them, so
    DeepSpeed's traffic can be read beside rayzero's `comm_stats()` (barriers count as all_reduce@N
    of one element). Returns the live dict, keyed "kind@group_size"."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    counts: dict[str, dict[str, int]] = {}
    # where the full tensor is: (position, keyword) in torch's signatures
    full_tensor = {"all_gather_into_tensor": (0, "output_tensor"), "reduce_scatter_tensor": (1, "input"),
                   "all_reduce": (0, "tensor"), "broadcast": (0, "tensor")}

    def wrap(name: str, original):
        def counted(*args, **kwargs):
            position, keyword = full_tensor[name]
            tensor = args[position] if len(args) > position else kwargs[keyword]
            group = kwargs.get("group")
            key = f"{name}@{dist.get_world_size(group)}"
            entry = counts.setdefault(key, {"calls": 0, "elements": 0, "bytes": 0})
            entry["calls"] += 1
            entry["elements"] += tensor.numel()
            entry["bytes"] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)
        return counted

    for name in full_tensor:
        counted = wrap(name, getattr(dist, name))
        setattr(dist, name, counted)
        setattr(c10d, name, counted)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="JSON: config, loop, cluster")
    _rank(json.loads(parser.parse_args().job))


if __name__ == "__main__":
    main()
