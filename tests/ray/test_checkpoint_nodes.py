"""Losing a node without shared storage: resume from the peer replicas on the surviving nodes.

A `ray.cluster_utils.Cluster` of 3 fake nodes, one training rank per node, each node with its own
local directory (RAYZERO_NODE_LOCAL_DIR) and no shared path. The 3 ranks train a real ZeroEngine
(stage 2), checkpoint with node-local storage and one replica per node, then one node is removed and
its directory deleted. Two fresh ranks on the surviving nodes resume at world size 2 and must
follow the uninterrupted loss curve.
"""
from __future__ import annotations

import os
import shutil
import sys

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster
from testkit.local_ray import add_node, own_ports

from rayzero.ports import server_port

GLOBAL_BATCH = 12


@ray.remote(num_cpus=0)
class TrainingRank:
    """One rank: its own process group membership, engine and node-local directory."""

    def __init__(self, rank: int, world: int, port: int, node_id: str, node_dir: str) -> None:
        os.environ.update(RAYZERO_NODE_ID=node_id, RAYZERO_NODE_LOCAL_DIR=node_dir)
        os.environ.pop("RAYZERO_CHECKPOINT_DIR", None)
        self.rank, self.world, self.port = rank, world, port

    def setup(self, init_seed: int) -> None:
        import datetime

        import torch
        import torch.distributed as dist

        from rayzero.engine.api import initialize

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{self.port}", rank=self.rank,
                                world_size=self.world, timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(init_seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // self.world, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
                  "zero_optimization": {"stage": 2}, "checkpoint": {"use_node_local_storage": True}}
        self.engine, *_ = initialize(model=model, config=config)

    def train(self, first: int, last: int) -> list[float]:
        import torch
        import torch.distributed as dist

        losses, micro = [], GLOBAL_BATCH // self.world
        for step in range(first, last):
            generator = torch.Generator().manual_seed(step)
            rows = slice(self.rank * micro, (self.rank + 1) * micro)
            inputs = torch.randn(GLOBAL_BATCH, 16, generator=generator)[rows]
            targets = torch.randn(GLOBAL_BATCH, 1, generator=generator)[rows]
            loss = torch.nn.functional.mse_loss(self.engine(inputs), targets)
            self.engine.backward(loss)
            self.engine.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / self.world)
        return losses

    def save(self) -> None:
        from rayzero.engine import checkpoint_io

        self.engine.save_checkpoint()  # save_dir=None: this node's RAYZERO_NODE_LOCAL_DIR/checkpoints
        checkpoint_io.wait_for_checkpoint(self.engine)

    def load(self) -> tuple[str, int, str]:
        path, _ = self.engine.load_checkpoint()
        return path, self.engine.global_steps, self.engine.checkpointer.saver.topology.locations[self.rank]

    def local_files(self) -> list[str]:
        tag_dir = os.path.join(os.environ["RAYZERO_NODE_LOCAL_DIR"], "checkpoints", "global_step4")
        return sorted(os.listdir(tag_dir)) if os.path.isdir(tag_dir) else []


def _ranks(world: int, nodes: list[int], dirs: list[str]):
    port = server_port()  # the group's MASTER_PORT: [Note: ports below the ephemeral range]
    return [TrainingRank.options(resources={f"n{node}": 0.1}).remote(rank, world, port, f"node-{node}", dirs[node])
            for rank, node in enumerate(nodes)]


def test_resume_from_peer_replicas_after_losing_a_node(tmp_path):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    if ray.is_initialized():
        ray.shutdown()
    dirs = [str(tmp_path / f"node{index}") for index in range(3)]
    cluster = Cluster()
    try:
        nodes = [add_node(cluster, num_cpus=1, resources={"n0": 1}, include_dashboard=False, **own_ports())]
        nodes += [add_node(cluster, num_cpus=1, resources={f"n{index}": 1}) for index in (1, 2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")

        ranks = _ranks(3, [0, 1, 2], dirs)
        ray.get([rank.setup.remote(0) for rank in ranks])
        ray.get([rank.train.remote(0, 4) for rank in ranks])
        ray.get([rank.save.remote() for rank in ranks])
        reference = ray.get([rank.train.remote(4, 8) for rank in ranks])[0]
        files = ray.get([rank.local_files.remote() for rank in ranks])
        # node k keeps its own shard and node k-1's replica; no node has all three
        # (and each node's owner marker, [Note: retention owns only its own])
        assert files == [["manifest.json", "rank00000.safetensors", "rank00002.safetensors", "rayzero-owner.json"],
                         ["manifest.json", "rank00000.safetensors", "rank00001.safetensors", "rayzero-owner.json"],
                         ["manifest.json", "rank00001.safetensors", "rank00002.safetensors", "rayzero-owner.json"]]
        for rank in ranks:
            ray.kill(rank)
        cluster.remove_node(nodes[2])
        shutil.rmtree(dirs[2])  # the lost node's disk is gone with it

        survivors = _ranks(2, [0, 1], dirs)
        ray.get([rank.setup.remote(1) for rank in survivors])
        loaded = ray.get([rank.load.remote() for rank in survivors])
        assert [(os.path.basename(path), steps) for path, steps, _ in loaded] == [("global_step4", 4)] * 2
        assert {location for _, _, location in loaded} == {"node-0", "node-1"}
        fetched = ray.get([rank.local_files.remote() for rank in survivors])
        assert any(set(now) - set(before) for now, before in zip(fetched, files)), "no shard came from a peer"
        resumed = ray.get([rank.train.remote(4, 8) for rank in survivors])[0]
        for got, want in zip(resumed, reference):
            assert abs(got - want) <= 1e-4 * abs(want), (resumed, reference)
    finally:
        ray.shutdown()
        cluster.shutdown()
