"""Where each rank runs: the node of every rank, found once per process group.

[Note: topology]
ZeRO's layouts beyond one node (hpZ's secondary partition, MiCS's shard groups, qgZ's two-stage
reduction) and the traffic counters' link classes need one fact: which ranks share a node. The
engine never asks Ray; it reads what the launcher put in the environment and all-gathers it once:
  - RAYZERO_NODE_ID: the Ray node id the worker runs on (rayzero's workers set it);
  - else GROUP_RANK / NODE_RANK: the node's index (torchrun, DeepSpeed's launcher, Lightning);
  - else the host name (a plain process group started by hand).
Each key is hashed to 63 bits and all-gathered as one int64 tensor (no pickling). Node indices are
given in order of first appearance, so node 0 holds rank 0. The runtime orders ranks so a node's
ranks are contiguous (rayzero/controller/worker_group.py `assign_ranks`, torchrun does the same);
layouts that follow node boundaries check it (`groups_fit_nodes`) and refuse otherwise.
Emulated nodes (network namespaces on one machine) share one host name but not a Ray node id,
which is why the host name comes last.
"""
from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

_NODE_KEYS = ("RAYZERO_NODE_ID", "GROUP_RANK", "NODE_RANK")


def node_key() -> str:
    """This process's node, as the launcher named it ([Note: topology])."""
    for name in _NODE_KEYS:
        value = os.environ.get(name)
        if value:
            return f"{name}={value}"
    return f"host={socket.gethostname()}"


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True)
class Topology:
    """The node index of every global rank (nodes numbered in order of first appearance)."""

    node_of: tuple[int, ...]

    @classmethod
    def single(cls, world_size: int = 1) -> Topology:
        """Every rank on one node (no process group, or a world the caller knows is one machine)."""
        return cls((0,) * world_size)

    @classmethod
    def discover(cls, group: dist.ProcessGroup | None = None) -> Topology:
        """All-gather every rank's node key over the default group (one int64 collective).

        Every rank of the world must call it. `group` only chooses the device of the tensor (NCCL
        needs a CUDA tensor); the map is of global ranks."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls.single()
        world = dist.get_world_size()
        device = torch.device("cpu")
        if dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        mine = torch.tensor([_hash(node_key())], dtype=torch.int64, device=device)
        keys = torch.empty(world, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(keys, mine)
        index: dict[int, int] = {}
        return cls(tuple(index.setdefault(key, len(index)) for key in keys.tolist()))

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def node_count(self) -> int:
        return len(set(self.node_of))

    def ranks_on(self, node: int) -> list[int]:
        return [rank for rank, where in enumerate(self.node_of) if where == node]

    def node_sizes(self) -> list[int]:
        return [len(self.ranks_on(node)) for node in range(self.node_count)]

    def contiguous(self) -> bool:
        """Each node's ranks form one run of consecutive ranks."""
        return all(ranks == list(range(ranks[0], ranks[0] + len(ranks)))
                   for ranks in (self.ranks_on(node) for node in range(self.node_count)))

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of[a] == self.node_of[b]

    def split_peers(self, rank: int, peers: Sequence[int]) -> tuple[int, int]:
        """(peers on `rank`'s node, peers elsewhere), `rank` itself not counted."""
        inside = sum(1 for peer in peers if peer != rank and self.same_node(rank, peer))
        outside = sum(1 for peer in peers if peer != rank and not self.same_node(rank, peer))
        return inside, outside

    def describe(self) -> str:
        """'2 nodes x 2 ranks' or 'nodes of 3, 1 ranks' (for messages and status)."""
        sizes = self.node_sizes()
        if len(set(sizes)) == 1:
            return f"{len(sizes)} node{'s' if len(sizes) != 1 else ''} x {sizes[0]} rank{'s' if sizes[0] != 1 else ''}"
        return f"{len(sizes)} nodes of {', '.join(map(str, sizes))} ranks"

    def groups_fit_nodes(self, size: int) -> str:
        """'' when consecutive groups of `size` ranks each lie inside one node or are whole nodes;
        else why not (the first group that splits a node)."""
        for start in range(0, self.world_size, size):
            members = range(start, start + size)
            nodes = sorted({self.node_of[r] for r in members})
            if len(nodes) == 1:
                continue
            whole = sum(len(self.ranks_on(node)) for node in nodes) == size
            if not whole:
                return (f"ranks {start}-{start + size - 1} would form one group but span part of node(s) "
                        f"{', '.join(str(n) for n in nodes)} ({self.describe()})")
        return ""
