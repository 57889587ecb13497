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

import atexit
import datetime
import itertools
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from rayzero.checkpoint.shard_file import CorruptShardError
from rayzero.config.environment import CHECKPOINT_TIMEOUT_S, NODE_ID

_CHUNK = 32 << 20  # bytes per message: bounds the memory a transfer holds at once

# [Note: gloo at interpreter exit]
# Gloo runs each collective on a worker thread of its process group, and that thread drops its
# reference to the finished work *after* the caller's wait() has returned. Dropping it frees the
# output tensors, which needs the GIL. If the process finalizes in that window (a script or a
# spawned rank that ends right after its last collective: a checkpoint commit, say), the thread is
# made to exit while taking the GIL and the C++ runtime aborts the process ("terminate called
# without an active exception", SIGABRT; seen in about one run in three of a 3-rank test on 2
# cores). A group in use keeps living after destroy_process_group() while anything (our
# CheckpointComm, the engine) still holds it, so destroying it does not close the window. What
# does: give the worker threads the GIL for a moment before finalization. Once any process group
# was used, an exit handler registered at import (so it runs after every handler registered later,
# the engine's leave-the-group one included) sleeps briefly.
_GROUP_USED = False
EXIT_SETTLE_S = 0.5  # 0.2 s was not always enough on 2 loaded cores


def note_process_group_used() -> None:
    """Called by whatever runs collectives (the checkpoint layer, the engine): see the note."""
    global _GROUP_USED
    _GROUP_USED = True


def _let_gloo_settle() -> None:
    if _GROUP_USED:
        import time

        time.sleep(EXIT_SETTLE_S)  # releases the GIL: the workers drop their last works ([Note: gloo at interpreter exit])


atexit.register(_let_gloo_settle)
DEFAULT_TIMEOUT_S = 1800.0

# [Note: gathering uneven objects]
# torch's all_gather_object pads every rank's pickled object to the largest one, so each rank
# receives world size x the largest. A load's exchanges are that uneven: with shared storage one
# rank lists a checkpoint's N files and the other N-1 send nothing, so every rank received N copies
# of an N-file listing (O(N^2) bytes per rank). `CheckpointComm.all_gather_object` gathers the sizes
# first and, when padding would cost more than twice the bytes there are, sums a buffer in which
# each rank wrote only its own bytes instead (an all-reduce moves about twice its size per rank):
# each rank then receives about twice the total, whatever its shape. Even objects (a save's specs
# and file entries) keep the single padded all-gather, which moves the least for them.
# `gather_cost` is the choice and its cost; bench/scale_loader.py uses it for its figures.


def gather_cost(sizes: Sequence[int]) -> tuple[bool, int]:
    """(padded?, bytes each rank receives) of gathering objects of these pickled sizes, one per rank,
    after the all-gather of the sizes themselves (8 bytes a rank): padded, each rank receives every
    other rank's slot of the largest size; summed, a ring all-reduce's two passes over the total."""
    world = len(sizes)
    padded = (world - 1) * max(sizes, default=0)
    summed = 2 * (world - 1) * sum(sizes) // max(world, 1)
    return (padded <= summed, min(padded, summed))


class CheckpointComm:
    """Rank, world and the collectives the checkpoint layer needs; a no-op group of one without
    torch.distributed."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            note_process_group_used()
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
        """Every rank's `value`, in rank order ([Note: gathering uneven objects])."""
        if self.group is None:
            return [value]
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=self.group)
        lengths = [int(size) for size in sizes]
        padded, _ = gather_cost(lengths)
        if padded:
            mine = torch.zeros(max(lengths), dtype=torch.uint8)
            mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            slots = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(slots, mine, group=self.group)
            blobs = [slot[:length] for slot, length in zip(slots, lengths)]
        else:
            offsets = list(itertools.accumulate(lengths, initial=0))
            packed = torch.zeros(offsets[-1], dtype=torch.uint8)  # each rank fills only its own bytes
            packed[offsets[self.rank]:offsets[self.rank + 1]] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.all_reduce(packed, group=self.group)  # a sum of disjoint pieces: every rank's bytes
            blobs = [packed[offsets[rank]:offsets[rank + 1]] for rank in range(self.world_size)]
        return [pickle.loads(memoryview(blob.numpy())) for blob in blobs]

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

    # Rank lookups are precomputed once per topology: a save plans the replicas of every rank on every
    # rank, and scanning `locations` per lookup made that O(world size^2) per rank (seconds at 4,096).
    @cached_property
    def _ranks_by_location(self) -> dict[str, list[int]]:
        """Each location's ranks, locations in order of their lowest rank."""
        ranks: dict[str, list[int]] = {}
        for rank, here in enumerate(self.locations):
            ranks.setdefault(here, []).append(rank)
        return ranks

    @cached_property
    def _placement(self) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """(ranks of each location in order, each rank's (location position, index among its ranks))."""
        groups = list(self._ranks_by_location.values())
        placement = [(0, 0)] * len(self.locations)
        for position, ranks in enumerate(groups):
            for index, rank in enumerate(ranks):
                placement[rank] = (position, index)
        return groups, placement

    @property
    def ordered_locations(self) -> list[str]:
        """Distinct locations in order of their lowest rank."""
        return list(self._ranks_by_location)

    def ranks_at(self, location: str) -> list[int]:
        return list(self._ranks_by_location.get(location, ()))

    def leader(self, location: str) -> int:
        """The rank that writes a location's manifest and `latest`."""
        return self._ranks_by_location[location][0]

    def replica_targets(self, rank: int, replicas: int) -> list[int]:
        """Ranks on the next `replicas` other locations that keep a copy of `rank`'s files.

        Location k+1 (cyclically) receives location k's files, rank by local index, so the replica
        load is spread evenly and a single lost node never takes both copies of a shard.
        """
        groups, placement = self._placement
        home, local_index = placement[rank]
        targets = []
        for hop in range(1, min(replicas, len(groups) - 1) + 1):
            peers = groups[(home + hop) % len(groups)]
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
    corrupt: list[tuple[Transfer, str]] = []
    for t in mine:
        if t.target != comm.rank:
            continue
        partial = target_path(t) + ".part"
        if digests[id(t)].hexdigest() != t.checksum:
            os.remove(partial)
            corrupt.append((t, digests[id(t)].hexdigest()))
        else:
            os.replace(partial, target_path(t))
    if corrupt:  # the good files are in place; the sender's copy of each of these is bad
        raise CorruptTransfersError(corrupt)


class CorruptTransfersError(CorruptShardError):
    """Files received whose bytes do not match the manifest: the sending rank's copy is corrupt.
    `transfers` names each, so the loader can drop that copy and fetch another."""

    def __init__(self, corrupt: list[tuple[Transfer, str]]) -> None:
        self.transfers = [transfer for transfer, _ in corrupt]
        first, actual = corrupt[0]
        super().__init__(f"{first.name} (received from rank {first.source})", first.checksum, actual)
        if len(corrupt) > 1:
            self.args = (f"{self.args[0]}; and {len(corrupt) - 1} more received file(s)",)

    def __reduce__(self):
        return (_corrupt_transfers, (self.transfers, self.actual))


def _corrupt_transfers(transfers: list[Transfer], actual: str) -> CorruptTransfersError:
    return CorruptTransfersError([(transfer, actual) for transfer in transfers])


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
