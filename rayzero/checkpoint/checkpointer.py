"""`Checkpointer`: the checkpoint layer's one entry point for a training process.

It owns the checkpoint process group, the background saver and the tier settings. Save and load
are collective: every rank of the job calls them with the same arguments.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import warnings
from collections.abc import Iterable
from typing import Any

from rayzero.checkpoint import rng
from rayzero.checkpoint.comm import CheckpointComm, Topology
from rayzero.checkpoint.durable import DurableStore
from rayzero.checkpoint.loader import LoadedCheckpoint, load
from rayzero.checkpoint.manifest import LATEST
from rayzero.checkpoint.options import CheckpointOptions, default_save_dir
from rayzero.checkpoint.save_failure import CheckpointSaveError
from rayzero.checkpoint.saver import CheckpointSaver, SaveTimings
from rayzero.checkpoint.types import ShardedTensor, ShardSpec
from rayzero.config.environment import NODE_LOCAL_DIR
from rayzero.config.errors import RayZeroValueError
from rayzero.config.names import check_name

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, options: CheckpointOptions | None = None) -> None:
        self.options = options or CheckpointOptions()
        self._comm: CheckpointComm | None = None
        self._saver: CheckpointSaver | None = None
        self._durable_stores: dict[str, DurableStore] = {}  # remote save/load locations, by URI

    @property
    def comm(self) -> CheckpointComm:
        # Created on first use: building the gloo group is itself collective ([Note: checkpoint process group]).
        if self._comm is None:
            self._comm = CheckpointComm(self.options.timeout_s)
        return self._comm

    @property
    def saver(self) -> CheckpointSaver:
        if self._saver is None:
            self._saver = CheckpointSaver(self.options, self.comm)
        return self._saver

    @property
    def topology(self) -> Topology:
        return self.saver.topology

    def resolve_dir(self, directory: str | os.PathLike | None) -> str:
        return self.locate(directory)[0]

    def locate(self, directory: str | os.PathLike | None) -> tuple[str, DurableStore | None]:
        """(local root, durable store) for a save/load location.

        A local path or file:// URI is the local root (the configured durable_uri, if any, gets the
        copy). Any other URI (s3://, gs://, hdfs://) is the durable copy itself, staged through the
        node's local disk: RAYZERO_NODE_LOCAL_DIR/checkpoints, else the temp directory.
        """
        location = os.fspath(directory) if directory is not None else default_save_dir(self.options)
        if location.startswith("file://"):
            location = location.removeprefix("file://")
        if "://" not in location:
            return location, self.saver.durable
        if location not in self._durable_stores:
            self._durable_stores[location] = DurableStore(location, self.options.upload_threads)
        digest = hashlib.blake2b(location.encode(), digest_size=6).hexdigest()
        staging_root = NODE_LOCAL_DIR.get() or tempfile.gettempdir()
        return os.path.join(staging_root, "checkpoints", f"staged-{digest}"), self._durable_stores[location]

    def save(self, save_dir: str | os.PathLike | None, tag: str, step: int, stage: int, shards: list[ShardedTensor],
             extra_state: dict[str, Any] | None = None, client_state: dict[str, Any] | None = None,
             config_digest: str = "", asynchronous: bool | None = None) -> str:
        """Snapshot and save (in the background unless `asynchronous=False`); returns the tag directory."""
        check_name(tag, "save_checkpoint(tag=...)")  # [Note: names that become paths]
        root, durable = self.locate(save_dir)
        os.makedirs(root, exist_ok=True)
        # the background save uses the checkpoint group; never run two collectives on it at once. A
        # save that failed on storage was reported and does not stop this one ([Note: a save that fails on storage])
        self.saver.settle()
        self._validate_tag(tag)
        return self.saver.save(root, tag, step, stage, config_digest, shards, extra_state or {},
                               client_state or {}, asynchronous, durable=durable)

    def wait(self) -> SaveTimings:
        """Block until the save in flight has committed (and uploaded); its timings. Raises its
        failure, once, a full disk included."""
        return self.saver.wait() if self._saver is not None else SaveTimings()

    @property
    def last_save_failure(self) -> CheckpointSaveError | None:
        """Why the newest save (or its durable copy) was not written, if storage refused it."""
        return self._saver.last_failure if self._saver is not None else None

    def complete_pending(self, reason: str) -> None:
        """Finish the save in flight, logging instead of raising a failure: for finalizers and
        exit paths, where nobody is left to catch it ([Note: async save completion] in saver.py)."""
        saver = self._saver
        if saver is None or not saver.in_flight:
            return
        log.info("waiting for the checkpoint save in flight to commit (%s)", reason)
        try:
            saver.wait()
        except Exception:  # nobody to raise to; the log names the failed save
            log.exception("the checkpoint save in flight failed while %s", reason)

    def use_fence(self) -> None:
        """Promise to call `fence()` before every update of the saved state, so async saves copy the
        state in the background too ([Note: snapshot fence] in saver.py)."""
        self.saver.fenced = True

    def fence(self) -> None:
        """Wait, if needed, until the save in flight has copied the state; call before updating it."""
        if self._saver is not None:
            self._saver.fence()

    def load(self, load_dir: str | os.PathLike | None, needed: Iterable[ShardSpec], tag: str | None = None,
             restore_rng: bool = True, destinations: dict[str, Any] | None = None) -> LoadedCheckpoint:
        """Choose, fetch and verify the checkpoint to resume from; restores this rank's RNG state.
        `destinations`: see `loader.load` (stream straight into the live state, bounded memory)."""
        if tag is not None:
            check_name(tag, "load_checkpoint(tag=...)")
        self.saver.settle()
        root, durable = self.locate(load_dir)
        loaded = load(self.comm, self.topology, root, needed, tag=tag, durable=durable,
                      destinations=destinations, lineage=self.saver.lineage())
        if restore_rng:
            rng.restore([state.get("rng") for state in loaded.manifest.rank_states], self.comm.rank)
        return loaded

    def _validate_tag(self, tag: str) -> None:
        if tag == LATEST:
            raise RayZeroValueError("save_checkpoint(tag='latest'): that name is the file naming the newest "
                                    "checkpoint; use another tag, e.g. 'global_step100'")
        mode = self.options.tag_validation
        if mode == "Ignore" or self.comm.world_size == 1:
            return
        tags = self.comm.all_gather_object(tag)
        if len(set(tags)) > 1:
            message = f"ranks passed different checkpoint tags {sorted(set(tags))}; every rank must use the same tag"
            if mode == "Fail":
                raise RayZeroValueError(message + " (checkpoint.tag_validation = 'Fail')")
            warnings.warn(message, stacklevel=3)
