"""Checkpoint traffic over torch.distributed: metadata exchange and whole-file transfers.

The checkpoint layer never imports ray, so copying a node's shards to another node (replicas at
save time, fetching missing shards at load time) goes over the training job's process group.

[Note: checkpoint process group]
All checkpoint collectives run on a dedicated gloo group created once, collectively, the first time
a checkpoint is saved or loaded. An async save runs its collectives in a background thread while
the training thread runs its own collectives; sharing one group would interleave the two streams
in a different order on different ranks and deadlock. Gloo because the payload is host memory and
gloo point-to-point works with any main backend (NCCL included).
"""
from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from rayzero.checkpoint.shard_file import CorruptShardError
from rayzero.config.environment import CHECKPOINT_TIMEOUT_S, NODE_ID

_CHUNK = 32 << 20  # bytes per message: bounds the memory a transfer holds at once
DEFAULT_TIMEOUT_S = 1800.0


class CheckpointComm:
    """Rank, world and the collectives the checkpoint layer needs; a no-op group of one without
    torch.distributed."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # see [Note: checkpoint process group]
        # Generous by default: a barrier here waits for the slowest rank's whole shard write.
        # `checkpoint.timeout_s` (the Checkpointer passes it, env override included); bare use reads the env.
        if timeout_s is None:
            timeout_s = CHECKPOINT_TIMEOUT_S.get() or DEFAULT_TIMEOUT_S
        timeout = datetime.timedelta(seconds=timeout_s)
        self.group = (dist.new_group(backend="gloo", timeout=timeout)
                      if self.distributed and self.world_size > 1 else None)
        self.node_ids: list[str] = self.all_gather_object(NODE_ID.get() or "node0")

    def all_gather_object(self, value: Any) -> list[Any]:
        if self.group is None:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def broadcast_object(self, value: Any, src: int = 0) -> Any:
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def all_true(self, flag: bool) -> bool:
        return all(self.all_gather_object(bool(flag)))


@dataclass(frozen=True)
class Topology:
    """Which ranks share a storage location (a node with node-local storage, else everyone)."""

    locations: tuple[str, ...]
    """Storage location of each rank."""

    @classmethod
    def from_nodes(cls, node_ids: Sequence[str], node_local: bool) -> Topology:
        return cls(tuple(node_ids) if node_local else tuple("shared" for _ in node_ids))

    @property
    def ordered_locations(self) -> list[str]:
        """Distinct locations in order of their lowest rank."""
        return list(dict.fromkeys(self.locations))

    def ranks_at(self, location: str) -> list[int]:
        return [rank for rank, here in enumerate(self.locations) if here == location]

    def leader(self, location: str) -> int:
        """The rank that writes a location's manifest and `latest`."""
        return self.ranks_at(location)[0]

    def replica_targets(self, rank: int, replicas: int) -> list[int]:
        """Ranks on the next `replicas` other locations that keep a copy of `rank`'s files.

        Location k+1 (cyclically) receives location k's files, rank by local index, so the replica
        load is spread evenly and a single lost node never takes both copies of a shard.
        """
        order = self.ordered_locations
        home = order.index(self.locations[rank])
        local_index = self.ranks_at(self.locations[rank]).index(rank)
        targets = []
        for hop in range(1, min(replicas, len(order) - 1) + 1):
            peers = self.ranks_at(order[(home + hop) % len(order)])
            targets.append(peers[local_index % len(peers)])
        return targets


@dataclass(frozen=True)
class Transfer:
    """Copy file `name` (of `size` bytes) from rank `source` to rank `target`."""

    source: int
    target: int
    name: str
    size: int
    checksum: str


def run_transfers(comm: CheckpointComm, transfers: Sequence[Transfer],
                  source_path: Callable[[Transfer], str], target_path: Callable[[Transfer], str]) -> None:
    """Execute `transfers` (the same list on every rank) in chunked rounds of isend/irecv.

    Every rank walks the same list in the same order, so messages between a pair of ranks match
    up first-in first-out. Received files are written under a temporary name, checksummed, and
    renamed into place; a mismatch raises CorruptShardError and leaves nothing behind.
    """
    if comm.group is None:
        return
    mine = [t for t in transfers if comm.rank in (t.source, t.target) and t.source != t.target]
    # many files open at once, closed together in the finally below
    readers = {id(t): open(source_path(t), "rb") for t in mine if t.source == comm.rank}  # noqa: SIM115
    # A receiver whose disk refuses (full, read-only) keeps receiving and drops the bytes: raising
    # before the rounds end would leave its senders blocked in isend ([Note: a save that fails on
    # storage] in save_failure.py). The first such error is raised once every round is done.
    refused: list[OSError] = []
    writers: dict[int, Any] = {}
    for t in mine:
        if t.target == comm.rank:
            try:
                writers[id(t)] = open(target_path(t) + ".part", "wb")  # noqa: SIM115
            except OSError as error:
                refused.append(_naming(error, target_path(t)))
                writers[id(t)] = None
    digests = {id(t): xxhash.xxh3_128() for t in mine if t.target == comm.rank}
    try:
        rounds = max((-(-t.size // _CHUNK) for t in mine), default=0)
        for round_index in range(rounds):
            pending, received = [], []
            for t in mine:
                begin = round_index * _CHUNK
                length = min(_CHUNK, t.size - begin)
                if length <= 0:
                    continue
                buffer = torch.empty(length, dtype=torch.uint8)
                if t.source == comm.rank:
                    readers[id(t)].readinto(memoryview(buffer.numpy()).cast("B"))
                    pending.append(dist.isend(buffer, dst=t.target, group=comm.group))
                else:
                    pending.append(dist.irecv(buffer, src=t.source, group=comm.group))
                    received.append((t, buffer))
            for work in pending:
                work.wait()
            for t, buffer in received:
                data = memoryview(buffer.numpy()).cast("B")
                digests[id(t)].update(data)
                if writers[id(t)] is not None:
                    try:
                        writers[id(t)].write(data)
                    except OSError as error:
                        refused.append(_naming(error, target_path(t)))
                        _close_and_remove(writers.pop(id(t)), target_path(t) + ".part")
                        writers[id(t)] = None
    finally:
        for handle in readers.values():
            handle.close()
        for handle in writers.values():
            try:
                if handle is not None:
                    handle.close()
            except OSError as error:  # a buffered write that meets a full disk fails at close
                refused.append(_naming(error, handle.name.removesuffix(".part")))
    if refused:
        for t in mine:
            if t.target == comm.rank:
                _remove(target_path(t) + ".part")
        raise refused[0]
    for t in mine:
        if t.target != comm.rank:
            continue
        partial = target_path(t) + ".part"
        if digests[id(t)].hexdigest() != t.checksum:
            os.remove(partial)
            raise CorruptShardError(f"{t.name} (received from rank {t.source})", t.checksum, digests[id(t)].hexdigest())
        os.replace(partial, target_path(t))


def _naming(error: OSError, path: str) -> OSError:
    """`error` with the file it concerns (a failed write() names none)."""
    return error if error.filename else OSError(error.errno, error.strerror or str(error), path)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _close_and_remove(handle: Any, path: str) -> None:
    try:
        handle.close()
    except OSError:
        pass
    _remove(path)
