"""The training loop bench/multinode.py (and tests/ray/test_multinode_emulated.py) run under
`rayzero.fit` on the emulated cluster: bench/models.py's GPT, fp32, the run's DeepSpeed config.

Every step is timed between two barriers (the slowest rank sets it); rank 0 reads the links' byte
counters (`tc -s`, bench/netcluster.py) after a barrier before the first measured step and after
the last one, so the bytes per step are what the measured steps put on the links (plus Ray's own
traffic meanwhile, a few kB/s). Rank 0 reports one dict at the end: step times, losses, the link
bytes, the engine's `comm_stats()` of the last step, and where every rank ran.
"""
from __future__ import annotations

import os
import time
from typing import Any


def train_loop(config: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    import rayzero
    from bench.models import build_model, trainable_parameters
    from bench.netcluster import NetCluster

    torch.set_num_threads(1)  # 4 ranks on 2 cores: one thread each, as bench/engine.py runs them
    size, warmup, steps = config["size"], int(config["warmup"]), int(config["steps"])
    cluster = NetCluster.from_description(config["cluster"]) if config.get("cluster") else None
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model("gpt", size)  # same weights on every rank (bench/models.py's seed)
    parameters = trainable_parameters(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    engine, _, _, _ = rayzero.initialize(model=model, optimizer=optimizer)

    measured = measure_steps(engine, cluster, size, warmup, steps)
    placement = [None] * world
    dist.all_gather_object(placement, _where_this_rank_runs(rank))
    if rank != 0:
        return
    rayzero.report({"bench": {"trainable_parameters": parameters, "world_size": world, "warmup": warmup,
                              "steps": steps, **measured, "comm_stats": _plain(engine.comm_stats()),
                              "placement": placement}})


def measure_steps(engine, cluster, size: str, warmup: int, steps: int, before_step=None, after_step=None
                  ) -> dict[str, Any]:
    """`warmup` + `steps` steps of bench/models.py's GPT batches through `engine` (rayzero's or
    DeepSpeed's: `engine(inputs, targets)` is the loss), each between two barriers; the link and
    loopback counters read around the measured steps. Rank 0's dict has them all; the losses are
    the mean over ranks (every rank gets them)."""
    import torch.distributed as dist

    from bench.models import batch
    from bench.netcluster import counter_delta

    rank, world = dist.get_rank(), dist.get_world_size()
    times, losses, before, loopback_before = [], [], None, None
    for step in range(warmup + steps):
        if step == warmup:
            before, loopback_before = _read_counters(cluster, rank)
        inputs, targets = batch("gpt", size, step, rank)
        dist.barrier()
        if before_step is not None:
            before_step()
        started = time.perf_counter()
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        dist.barrier()
        times.append(time.perf_counter() - started)
        if after_step is not None:
            after_step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    after, loopback_after = _read_counters(cluster, rank)
    out: dict[str, Any] = {"step_times_s": times[warmup:], "warmup_step_times_s": times[:warmup], "losses": losses}
    if cluster is not None and rank == 0:
        out["link_bytes"] = counter_delta(after, before)
        out["loopback_bytes"] = counter_delta(loopback_after, loopback_before)
    return out


def _read_counters(cluster, rank: int) -> tuple[dict | None, dict | None]:
    """Rank 0 reads the counters while every rank waits at a barrier on either side."""
    import torch.distributed as dist

    dist.barrier()
    counters = (cluster.link_counters(), cluster.loopback_bytes()) if cluster is not None and rank == 0 else (None, None)
    dist.barrier()
    return counters


def _where_this_rank_runs(rank: int) -> dict[str, Any]:
    """The rank's environment as rayzero set it, its Ray node's address, and its established TCP
    connections (local and remote address), to find which address its gloo traffic uses."""
    import psutil
    import ray

    def ip(address: str) -> str:  # the TCPStore listens on both stacks: IPv4 peers show as ::ffff:a.b.c.d
        return address.removeprefix("::ffff:")

    connections = [(ip(c.laddr.ip), c.laddr.port, ip(c.raddr.ip), c.raddr.port)
                   for c in psutil.Process().net_connections(kind="tcp")
                   if c.status == psutil.CONN_ESTABLISHED and c.raddr]
    listening = sorted({c.laddr.port for c in psutil.Process().net_connections(kind="tcp")
                        if c.status == psutil.CONN_LISTEN})
    env = {key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                                                 "GROUP_WORLD_SIZE", "MASTER_ADDR", "GLOO_SOCKET_IFNAME")}
    return {"rank": rank, "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "env": env,
            "connections": connections, "listening": listening}


def rank_links(placement: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The TCP connections between two ranks of the run (gloo's, and its TCPStore's), each with the
    addresses at both ends and the node address each rank's Ray node has: one connection's two ends
    are found as the same (ip, port) pairs seen from both processes."""
    ends = {}
    for info in placement:
        for local_ip, local_port, remote_ip, remote_port in info["connections"]:
            ends[(local_ip, local_port, remote_ip, remote_port)] = info["rank"]
    links = []
    for (local_ip, local_port, remote_ip, remote_port), rank in ends.items():
        peer = ends.get((remote_ip, remote_port, local_ip, local_port))
        if peer is not None and rank < peer:
            links.append({"ranks": (rank, peer), "addresses": (local_ip, remote_ip),
                          "node_ips": (placement[rank]["node_ip"], placement[peer]["node_ip"])})
    return links


def _plain(value: Any) -> Any:
    """JSON-ready: dicts and lists of numbers and strings (tensors as lists)."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    return value
