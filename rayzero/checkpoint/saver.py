"""Saving: snapshot in the caller's thread, then write, replicate, commit and upload (async).

The blocking part of a save is only the snapshot: every rank's state pieces copied to fresh host
tensors (the training step mutates the live ones in place) plus its RNG state. Everything else --
the shard file, the metadata exchange, peer replicas, the manifest commit, `latest`, retention and
the durable upload -- runs in one background thread per process on the checkpoint process group
([Note: checkpoint process group] in comm.py). One save is in flight at a time: the next save (or
a load) first waits for it.

[Note: snapshot fence]
Copying the state to host buffers is the only part of a save that must finish before the state
changes, i.e. before the next optimizer step; forward and backward only read it. When the owner of
the state promises to call `fence()` before every update (the engine glue does it from an optimizer
step pre-hook, `fenced = True`), the copy moves into the background thread too and overlaps the
next forward/backward: save() then blocks only for metadata, and the fence waits only if the copy
is still running when the optimizer step begins. Without that promise the copy happens in save().

[Note: async save completion]
An async save is finished by a background thread that runs collectives on the checkpoint group.
A training loop that returns without `wait_for_checkpoint()` would let its caller destroy the
process group (the Ray worker does, right after the loop) or kill the process while that thread is
mid-write: the newest checkpoint would silently never commit. Three things close that gap:
`wait()` is idempotent and cheap, so every exit path may call it; the engine glue attaches a
`weakref.finalize` to the engine that waits when the engine is released (the loop's locals go
away as it returns) and at interpreter exit; and `wait_for_pending_saves()` waits for every save
in flight in this process, for a runner to call after the loop whatever still references the engine.
The thread itself is not a daemon, so a plain script's interpreter joins it before exiting.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from rayzero.checkpoint import rng
from rayzero.checkpoint.comm import CheckpointComm, Topology, Transfer, run_transfers
from rayzero.checkpoint.direct_io import aligned_empty
from rayzero.checkpoint.durable import DurableStore
from rayzero.checkpoint.manifest import (
    MANIFEST,
    RUN_SESSION_ENV,
    FileEntry,
    Manifest,
    apply_retention,
    commit,
    set_latest,
    shard_file_name,
)
from rayzero.checkpoint.options import CheckpointOptions
from rayzero.checkpoint.reshard import build_tensor_entries, choose_writers
from rayzero.checkpoint.shard_file import write_shard_file
from rayzero.checkpoint.types import LazyPiece, ShardedTensor
from rayzero.config.errors import RayZeroRuntimeError

log = logging.getLogger(__name__)

# Savers with a save in flight, so a runner can finish them all after the training loop returns
# ([Note: async save completion]); weak, so an abandoned saver still goes away with its engine.
_IN_FLIGHT: weakref.WeakSet[CheckpointSaver] = weakref.WeakSet()


def wait_for_pending_saves() -> int:
    """Block until every checkpoint save still in flight in this process has committed and uploaded;
    how many there were. Errors are logged, not raised (the owner's `wait()` raises them)."""
    pending = [saver for saver in list(_IN_FLIGHT) if saver.in_flight]
    for saver in pending:
        saver.join()
    return len(pending)


@dataclass
class SaveTimings:
    """Seconds spent in each phase of the last save on this rank."""

    blocking: float = 0.0
    """Time the training thread was held: inside save() (waiting for the previous save, the snapshot
    unless deferred) plus any wait at the snapshot fence."""
    write: float = 0.0
    replicate: float = 0.0
    commit: float = 0.0
    upload: float = 0.0
    total: float = 0.0
    """From save() being called to the local commit (upload excluded)."""
    bytes_written: int = 0


@dataclass
class _SaveJob:
    root: str
    tag: str
    step: int
    stage: int
    config_digest: str
    shards: list[ShardedTensor]
    extra_state: dict[str, Any]
    client_state: dict[str, Any]
    rng_state: dict[str, Any]
    started: float
    manifest: Manifest | None = None
    """Set once committed."""
    durable: DurableStore | None = None
    """Where the durable copy goes, if anywhere."""
    deferred_snapshot: bool = False
    """The live tensors still have to be copied (by the background thread, before writing)."""
    timings: SaveTimings = field(default_factory=SaveTimings)


class CheckpointSaver:
    """Writes checkpoints for one process; create one per engine and reuse it."""

    def __init__(self, options: CheckpointOptions, comm: CheckpointComm) -> None:
        self.options = options
        self.comm = comm
        self.topology = Topology.from_nodes(comm.node_ids, options.node_local)
        self.durable = DurableStore(options.durable_uri, options.upload_threads) if options.durable_uri else None
        self.timings = SaveTimings()  # of the last save that finished
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging: dict[str, torch.Tensor] = {}  # snapshot buffers reused by every async save
        self.fenced = False  # set by the owner once it calls fence() before every state update
        self._snapshot_ready: threading.Event | None = None  # set when the save in flight has its copy
        self._copy_after: Any = None  # CUDA event: the background copy starts after it
        self._job_timings = SaveTimings()
        self._session = os.environ.get(RUN_SESSION_ENV, "")  # [Note: retention owns only its own]
        self._committed_here: set[str] = set()  # tags this process committed (deletable outside a session)
        if options.node_local and options.replicas and len(self.topology.ordered_locations) < 2 and comm.rank == 0:
            log.warning("checkpoint.use_node_local_storage with replicas=%d but the job runs on one node: "
                        "no peer replicas can be kept, losing this node loses its checkpoints unless a "
                        "durable_uri is set", options.replicas)

    def save(self, root: str, tag: str, step: int, stage: int, config_digest: str,
             shards: list[ShardedTensor], extra_state: dict[str, Any], client_state: dict[str, Any],
             asynchronous: bool | None = None, durable: DurableStore | None = None) -> str:
        """Save a checkpoint under root/tag; returns the tag directory. Collective over all ranks.
        `durable`: where the copy goes (default: the configured durable_uri)."""
        started = time.perf_counter()
        self.wait()
        asynchronous = self.options.async_save if asynchronous is None else asynchronous
        if asynchronous and any(isinstance(shard.local, LazyPiece) for shard in shards):
            # [Note: streamed save]: a background snapshot would hold every piece in memory at once;
            # pieces on NVMe are written one at a time before save() returns instead.
            asynchronous = False
        deferred = asynchronous and self.fenced
        if deferred:
            # [Note: snapshot fence]: the copy runs in the background; the training thread waits only
            # if it reaches the fence (the optimizer step) before the copy is done.
            self._snapshot_ready = threading.Event()
            if any(shard.local.device.type == "cuda" for shard in shards):
                self._copy_after = torch.cuda.Event()
                self._copy_after.record()  # the copy must see every update queued so far
        elif asynchronous:
            shards = self._snapshot(shards)
        else:
            shards = [s if isinstance(s.local, LazyPiece) else ShardedTensor(s.spec, s.local.detach().cpu())
                      for s in shards]
        job = _SaveJob(root, tag, step, stage, config_digest, shards, dict(extra_state), dict(client_state),
                       rng.capture(), started, deferred_snapshot=deferred,
                       durable=durable if durable is not None else self.durable)
        job.timings.blocking = time.perf_counter() - started
        self._job_timings = job.timings
        if asynchronous:
            self._thread = threading.Thread(target=self._run, args=(job,), name="rayzero-checkpoint", daemon=False)
            self._thread.start()
            _IN_FLIGHT.add(self)
        else:
            self._run(job, until_commit=True)
            self.wait()  # raises if the commit failed
            # Committed and durable on local disk: retention and the upload need not hold the caller.
            self._thread = threading.Thread(target=self._finish, args=(job,), name="rayzero-checkpoint", daemon=False)
            self._thread.start()
            _IN_FLIGHT.add(self)
        return os.path.join(root, tag)

    def fence(self) -> None:
        """Call before changing state that a save in flight may still be copying ([Note: snapshot fence])."""
        ready = self._snapshot_ready
        if ready is not None and not ready.is_set():
            started = time.perf_counter()
            ready.wait()
            self._job_timings.blocking += time.perf_counter() - started

    def _snapshot(self, shards: list[ShardedTensor]) -> list[ShardedTensor]:
        """Copy the live pieces (the step loop changes them the moment save returns) into host
        buffers kept from the previous save: a copy into memory that is already mapped runs several
        times faster than into fresh allocations (no page faults). Costs one host copy of the
        rank's state between saves."""
        on_accelerator = any(shard.local.device.type != "cpu" for shard in shards)
        if on_accelerator and self._copy_after is not None:  # background copy: own stream, ordered after
            stream = torch.cuda.Stream()                       # the updates queued before save() returned
            stream.wait_event(self._copy_after)
            with torch.cuda.stream(stream):
                return self._copy_to_staging(shards, on_accelerator)
        return self._copy_to_staging(shards, on_accelerator)

    def _copy_to_staging(self, shards: list[ShardedTensor], on_accelerator: bool) -> list[ShardedTensor]:
        snapshot = []
        for shard in shards:
            local = shard.local.detach().reshape(-1)
            buffer = self._staging.get(shard.spec.name)
            if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                # pinned memory is page-aligned too: either way the shard file is written from it with no copy
                buffer = (torch.empty(local.shape, dtype=local.dtype, pin_memory=True) if on_accelerator
                          else aligned_empty(local.numel(), local.dtype))
                self._staging[shard.spec.name] = buffer
            buffer.copy_(local, non_blocking=on_accelerator)
            snapshot.append(ShardedTensor(shard.spec, buffer))
        if on_accelerator:
            torch.cuda.current_stream().synchronize()  # the non-blocking device-to-host copies must land first
        return snapshot

    def join(self) -> None:
        """Block until the save in flight (if any) has finished, without raising its error (kept for
        `wait()`). Safe to call from any thread, any number of times."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def wait(self) -> SaveTimings:
        """Block until the save in flight (if any) has committed and uploaded; re-raise its error
        once. Idempotent: with nothing in flight it returns the last timings at once."""
        self.join()
        self._thread = None
        _IN_FLIGHT.discard(self)
        if self._error is not None:
            error, self._error = self._error, None
            raise RayZeroRuntimeError(f"the previous checkpoint save failed on rank {self.comm.rank}: {error}") from error
        return self.timings

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self, job: _SaveJob, until_commit: bool = False) -> None:
        try:
            if job.deferred_snapshot:
                try:
                    job.shards = self._snapshot(job.shards)
                finally:
                    self._snapshot_ready.set()  # never leave the training thread waiting at the fence
                    self._copy_after = None
            self._write(job)
        except BaseException as error:  # surfaced by wait() in the training thread
            log.exception("checkpoint save of %s failed on rank %d", job.tag, self.comm.rank)
            self._error = error
            return
        if not until_commit:
            self._finish(job)

    def _owns(self, manifest: Manifest) -> bool:
        """May retention delete this checkpoint? ([Note: retention owns only its own] in manifest.py)"""
        if self._session:
            return manifest.run_session == self._session
        return manifest.tag in self._committed_here

    def _finish(self, job: _SaveJob) -> None:
        """After the commit: retention, then the durable copy (its manifest once every rank uploaded)."""
        comm, options, topology = self.comm, self.options, self.topology
        try:
            if comm.rank == topology.leader(topology.locations[comm.rank]):
                apply_retention(job.root, options.keep_last, keep={job.tag}, owned=self._owns)
            if job.durable is not None:
                phase = time.perf_counter()
                written = shard_file_name(comm.rank)
                job.durable.upload(job.tag, [(os.path.join(job.root, job.tag, written), written)])
                comm.barrier()
                if comm.rank == 0:
                    job.durable.commit(job.manifest)
                    job.durable.apply_retention(options.keep_last, owned=self._owns)
                comm.barrier()  # so wait() on any rank means: durably committed
                job.timings.upload = time.perf_counter() - phase
            self.timings = job.timings
        except BaseException as error:  # surfaced by wait() in the training thread
            log.exception("checkpoint retention/upload of %s failed on rank %d", job.tag, comm.rank)
            self._error = error

    def _write(self, job: _SaveJob) -> None:
        comm, options, topology = self.comm, self.options, self.topology
        tag_dir = os.path.join(job.root, job.tag)
        leader = comm.rank == topology.leader(topology.locations[comm.rank])
        os.makedirs(tag_dir, exist_ok=True)
        if leader:
            # Re-saving an existing tag: un-commit it before overwriting any of its files.
            try:
                os.remove(os.path.join(tag_dir, MANIFEST))
            except FileNotFoundError:
                pass
        specs_by_rank = comm.all_gather_object([shard.spec for shard in job.shards])
        writers = choose_writers(specs_by_rank)
        tensors = build_tensor_entries(specs_by_rank, writers)
        mine = [(shard.spec.name, shard.local) for shard in job.shards if shard.spec.name in writers[comm.rank]]

        phase = time.perf_counter()
        written = write_shard_file(os.path.join(tag_dir, shard_file_name(comm.rank)), mine, fsync=options.fsync)
        job.shards.clear()  # the snapshot is on disk: free its memory before replicating
        job.timings.write = time.perf_counter() - phase
        job.timings.bytes_written = written.size

        gathered = comm.all_gather_object((written, job.rng_state))
        files = {file.name: FileEntry(file.size, file.checksum, rank, comm.node_ids[rank])
                 for rank, (file, _) in enumerate(gathered)}
        phase = time.perf_counter()
        if options.node_local and options.replicas:
            transfers = [Transfer(rank, target, shard_file_name(rank), files[shard_file_name(rank)].size,
                                  files[shard_file_name(rank)].checksum)
                         for rank in range(comm.world_size) for target in topology.replica_targets(rank, options.replicas)]
            in_tag = lambda transfer: os.path.join(tag_dir, transfer.name)
            run_transfers(comm, transfers, in_tag, in_tag)
        job.timings.replicate = time.perf_counter() - phase

        manifest = Manifest(
            tag=job.tag, step=job.step, world_size=comm.world_size, stage=job.stage,
            config_digest=job.config_digest, files=files, tensors=tensors,
            rank_states=[{"rank": rank, "node": comm.node_ids[rank], "rng": state}
                         for rank, (_, state) in enumerate(gathered)],
            extra_state=job.extra_state, client_state=job.client_state, run_session=self._session)
        phase = time.perf_counter()
        comm.barrier()  # every shard and replica is on disk everywhere: now commit
        if leader:
            commit(tag_dir, manifest)
            set_latest(job.root, job.tag)
        comm.barrier()  # load_checkpoint right after save_checkpoint sees the commit on every node
        job.timings.commit = time.perf_counter() - phase
        job.timings.total = time.perf_counter() - job.started
        job.manifest = manifest
        self._committed_here.add(job.tag)
