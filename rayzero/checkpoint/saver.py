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

[Note: a commit that space cannot tear]
Once a manifest is visible, anything that lists checkpoints (the ranks' heartbeats, the controller,
`rayzero status`, another process's loader) may take the checkpoint as committed, so it must never
be taken back. What can still fail for space (a disk filling up mid-save) therefore fails before
anything is visible: each location's leader first writes both small files under temporary names
(the manifest in the tag directory, `latest` in the save directory, fsynced), the ranks exchange
their problems, and only if none had one does each leader rename them into place, the manifest
first. A rename allocates no data block. Before, the manifest was visible while `latest` could
still fail: the chaos soak saw a status list step 400 as committed, then the save's undo remove it.
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
from rayzero.checkpoint.collector import collector_paused
from rayzero.checkpoint.comm import CheckpointComm, Topology, Transfer, run_transfers
from rayzero.checkpoint.direct_io import aligned_empty
from rayzero.checkpoint.durable import DurableStore
from rayzero.checkpoint.manifest import (
    LATEST,
    MANIFEST,
    FileEntry,
    Manifest,
    Staged,
    publish,
    read_latest,
    set_latest,
    shard_file_name,
    stage,
    stage_manifest,
)
from rayzero.checkpoint.options import CheckpointOptions
from rayzero.checkpoint.reshard import build_tensor_entries, choose_writers
from rayzero.checkpoint.retention import (
    apply_retention,
    claim_tag_dir,
    new_lineage,
    owner_of,
    remove_tag_dir,
)
from rayzero.checkpoint.save_failure import CheckpointSaveError, StorageProblem, noting
from rayzero.checkpoint.shard_file import write_shard_file
from rayzero.checkpoint.types import LazyPiece, ShardedTensor
from rayzero.config.environment import RUN_LINEAGE
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
    previous_latest: str | None = None
    """What `latest` named before this save (put back if the save fails after moving it)."""
    latest_moved: bool = False


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
        self._lineage: str | None = None  # who owns what this saver writes ([Note: retention owns only its own])
        self.last_failure: CheckpointSaveError | None = None  # of the newest save, if storage refused it
        self._unraised_failure: CheckpointSaveError | None = None  # for an explicit wait() to raise once
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
        self.settle()
        self.lineage()  # collective the first time: before any background thread uses the group
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
            self._raise_fatal()  # a storage failure is reported, not raised (an explicit wait() raises it)
            if job.manifest is None:
                return os.path.join(root, tag)
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

    def lineage(self) -> str:
        """The run lineage owning what this saver writes: RAYZERO_RUN_LINEAGE (set by `rayzero.fit`),
        else rank 0's fresh id. Collective on first use ([Note: retention owns only its own])."""
        if self._lineage is None:
            self._lineage = self.comm.broadcast_object(RUN_LINEAGE.get() or new_lineage())
        return self._lineage

    def settle(self) -> None:
        """Before a new save or a load: wait for the save in flight and re-raise a failure other than
        on storage. A storage failure was reported when it happened; it does not stop training and
        is forgotten here ([Note: a save that fails on storage])."""
        self._raise_fatal()
        self._unraised_failure = None

    def _raise_fatal(self) -> None:
        self.join()
        self._thread = None
        _IN_FLIGHT.discard(self)
        if self._error is not None:
            error, self._error = self._error, None
            raise RayZeroRuntimeError(f"the previous checkpoint save failed on rank {self.comm.rank}: {error}") from error

    def wait(self) -> SaveTimings:
        """Block until the save in flight (if any) has committed and uploaded; re-raise its error
        once, a storage failure included. Idempotent: with nothing in flight it returns the last
        timings at once."""
        self.join()
        failure, self._unraised_failure = self._unraised_failure, None
        self._raise_fatal()
        if failure is not None:
            raise failure
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
        except CheckpointSaveError as failure:
            job.shards.clear()
            self._undo_local(job)
            self._report(failure)
            return
        except BaseException as error:  # surfaced by wait() in the training thread
            log.exception("checkpoint save of %s failed on rank %d", job.tag, self.comm.rank)
            self._error = error
            return
        self.last_failure = None
        if not until_commit:
            self._finish(job)

    def _report(self, failure: CheckpointSaveError) -> None:
        """[Note: a save that fails on storage]: said once (rank 0 names every rank's problem), kept
        for an explicit wait(), never raised into the training thread by the next save."""
        self.last_failure = self._unraised_failure = failure
        if self.comm.rank == 0:
            log.error("%s", failure)

    def _exchange(self, tag: str, tier: str, payload: Any, problems: list[StorageProblem]) -> list[Any]:
        """All-gather `payload`, and every rank's storage problems with it; if any rank had one,
        every rank raises the same CheckpointSaveError here ([Note: a save that fails on storage])."""
        gathered = self.comm.all_gather_object((payload, problems))
        everyone = [problem for _, theirs in gathered for problem in theirs]
        if everyone:
            raise CheckpointSaveError(tag, tier, everyone)
        return [mine for mine, _ in gathered]

    def _undo_local(self, job: _SaveJob) -> None:
        """After a failed save: each location's leader removes its partial tag directory (only if its
        marker names our lineage) and puts `latest` back where this save moved it."""
        topology = self.topology
        if self.comm.rank != topology.leader(topology.locations[self.comm.rank]):
            return
        tag_dir = os.path.join(job.root, job.tag)
        try:
            if job.latest_moved and job.previous_latest:
                set_latest(job.root, job.previous_latest)
            elif job.latest_moved:
                os.remove(os.path.join(job.root, LATEST))
            if os.path.isdir(tag_dir) and owner_of(tag_dir) == self.lineage():
                remove_tag_dir(tag_dir)
        except OSError as error:
            log.warning("could not clean up after the failed save of %s: %s", tag_dir, error)

    def _finish(self, job: _SaveJob) -> None:
        """After the commit: retention, then the durable copy (its manifest once every rank uploaded)."""
        comm, options, topology = self.comm, self.options, self.topology
        try:
            if comm.rank == topology.leader(topology.locations[comm.rank]):
                apply_retention(job.root, options.keep_last, self.lineage(), keep={job.tag})
            if job.durable is not None:
                phase = time.perf_counter()
                self._upload(job)
                job.timings.upload = time.perf_counter() - phase
            self.timings = job.timings
        except CheckpointSaveError as failure:
            self._report(failure)
        except BaseException as error:  # surfaced by wait() in the training thread
            log.exception("checkpoint retention/upload of %s failed on rank %d", job.tag, comm.rank)
            self._error = error

    def _upload(self, job: _SaveJob) -> None:
        """The durable copy: claimed by rank 0, each rank uploads its file, rank 0 commits (manifest,
        then `latest`) and rotates; a failure anywhere removes the partial copy
        ([Note: a save that fails on storage])."""
        comm, durable, lineage = self.comm, job.durable, self.lineage()
        problems: list[StorageProblem] = []
        if comm.rank == 0:
            with noting(problems, 0, durable.location(job.tag)):
                durable.claim(job.tag, lineage)
        self._exchange(job.tag, "durable", None, problems)
        written = shard_file_name(comm.rank)
        try:
            with noting(problems, comm.rank, durable.location(job.tag, written)):
                durable.upload(job.tag, [(os.path.join(job.root, job.tag, written), written)])
            self._exchange(job.tag, "durable", None, problems)
            if comm.rank == 0:
                with noting(problems, 0, durable.location(job.tag, MANIFEST)):
                    durable.commit(job.manifest)
                if not problems:
                    durable.apply_retention(self.options.keep_last, lineage, keep={job.tag})
            self._exchange(job.tag, "durable", None, problems)  # so wait() on any rank means: durably committed
        except CheckpointSaveError:
            if comm.rank == 0:
                durable.discard(job.tag, lineage)
            raise

    def _write(self, job: _SaveJob) -> None:
        comm, options, topology = self.comm, self.options, self.topology
        tag_dir = os.path.join(job.root, job.tag)
        leader = comm.rank == topology.leader(topology.locations[comm.rank])
        problems: list[StorageProblem] = []  # [Note: a save that fails on storage]
        if leader:
            with noting(problems, comm.rank, tag_dir):
                # [Note: retention owns only its own]: the marker goes in before any shard byte
                claim_tag_dir(tag_dir, self.lineage())
                # Re-saving an existing tag: un-commit it before overwriting any of its files.
                try:
                    os.remove(os.path.join(tag_dir, MANIFEST))
                except FileNotFoundError:
                    pass
        specs_by_rank = self._exchange(job.tag, "local", [shard.spec for shard in job.shards], problems)
        writers = choose_writers(specs_by_rank)
        tensors = build_tensor_entries(specs_by_rank, writers)
        mine = [(shard.spec.name, shard.local) for shard in job.shards if shard.spec.name in writers[comm.rank]]

        phase = time.perf_counter()
        path = os.path.join(tag_dir, shard_file_name(comm.rank))
        written = None
        with noting(problems, comm.rank, path):
            written = write_shard_file(path, mine, fsync=options.fsync)
        job.shards.clear()  # the snapshot is on disk: free its memory before replicating
        job.timings.write = time.perf_counter() - phase
        job.timings.bytes_written = written.size if written is not None else 0

        gathered = self._exchange(job.tag, "local", (written, job.rng_state), problems)
        files = {file.name: FileEntry(file.size, file.checksum, rank, comm.node_ids[rank])
                 for rank, (file, _) in enumerate(gathered)}
        phase = time.perf_counter()
        if options.node_local and options.replicas:
            transfers = [Transfer(rank, target, shard_file_name(rank), files[shard_file_name(rank)].size,
                                  files[shard_file_name(rank)].checksum)
                         for rank in range(comm.world_size) for target in topology.replica_targets(rank, options.replicas)]
            in_tag = lambda transfer: os.path.join(tag_dir, transfer.name)
            with noting(problems, comm.rank, tag_dir):
                run_transfers(comm, transfers, in_tag, in_tag)
        job.timings.replicate = time.perf_counter() - phase

        with collector_paused():
            manifest = Manifest(
                tag=job.tag, step=job.step, world_size=comm.world_size, stage=job.stage,
                config_digest=job.config_digest, files=files, tensors=tensors,
                rank_states=[{"rank": rank, "node": comm.node_ids[rank], "rng": state}
                             for rank, (_, state) in enumerate(gathered)],
                extra_state=job.extra_state, client_state=job.client_state, lineage=self.lineage())
        phase = time.perf_counter()
        self._exchange(job.tag, "local", None, problems)  # every shard and replica is on disk everywhere: commit
        # [Note: a commit that space cannot tear]
        staged: list[Staged] = []
        if leader:
            job.previous_latest = read_latest(job.root)
            with noting(problems, comm.rank, os.path.join(tag_dir, MANIFEST)):
                staged.append(stage_manifest(tag_dir, manifest))
            if not problems:
                with noting(problems, comm.rank, os.path.join(job.root, LATEST)):
                    staged.append(stage(os.path.join(job.root, LATEST), job.tag + "\n"))
        try:
            self._exchange(job.tag, "local", None, problems)  # both written at every location: make them visible
        except CheckpointSaveError:
            for written in staged:
                written.discard()
            raise
        for written in staged:
            if problems:  # a manifest not made visible: `latest` must not name it
                written.discard()
                continue
            with noting(problems, comm.rank, written.path):
                publish(written)
        job.latest_moved = bool(staged) and not problems  # the manifest, then `latest`: both or not `latest`
        self._exchange(job.tag, "local", None, problems)  # load_checkpoint right after save_checkpoint sees the commit
        job.timings.commit = time.perf_counter() - phase
        job.timings.total = time.perf_counter() - job.started
        job.manifest = manifest
