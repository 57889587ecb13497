"""`Checkpointer`: the checkpoint layer's one entry point for a training process.

It owns the checkpoint process group, the background saver and the tier settings. Save and load
are collective: every rank of the job calls them with the same arguments.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from typing import Any

from rayzero.checkpoint import rng
from rayzero.checkpoint.comm import CheckpointComm, Topology
from rayzero.checkpoint.loader import LoadedCheckpoint, load
from rayzero.checkpoint.options import CheckpointOptions, default_save_dir
from rayzero.checkpoint.saver import CheckpointSaver, SaveTimings
from rayzero.checkpoint.types import ShardedTensor, ShardSpec


class Checkpointer:
    def __init__(self, options: CheckpointOptions | None = None) -> None:
        self.options = options or CheckpointOptions()
        self._comm: CheckpointComm | None = None
        self._saver: CheckpointSaver | None = None

    @property
    def comm(self) -> CheckpointComm:
        # Created on first use: building the gloo group is itself collective ([Note: checkpoint process group]).
        if self._comm is None:
            self._comm = CheckpointComm()
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
        return os.fspath(directory) if directory is not None else default_save_dir(self.options)

    def save(self, save_dir: str | os.PathLike | None, tag: str, step: int, stage: int, shards: list[ShardedTensor],
             extra_state: dict[str, Any] | None = None, client_state: dict[str, Any] | None = None,
             config_digest: str = "", asynchronous: bool | None = None) -> str:
        """Snapshot and save (in the background unless `asynchronous=False`); returns the tag directory."""
        root = self.resolve_dir(save_dir)
        os.makedirs(root, exist_ok=True)
        self.wait()  # the background save uses the checkpoint group; never run two collectives on it at once
        self._validate_tag(tag)
        return self.saver.save(root, tag, step, stage, config_digest, shards, extra_state or {},
                               client_state or {}, asynchronous)

    def wait(self) -> SaveTimings:
        """Block until the save in flight has committed (and uploaded); its timings."""
        return self.saver.wait() if self._saver is not None else SaveTimings()

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
        self.wait()
        root = self.resolve_dir(load_dir)
        loaded = load(self.comm, self.topology, root, needed, tag=tag, durable=self.saver.durable,
                      destinations=destinations)
        if restore_rng:
            rng.restore([state["rng"] for state in loaded.manifest.rank_states], self.comm.rank)
        return loaded

    def _validate_tag(self, tag: str) -> None:
        if not tag or os.sep in tag or tag in (".", "..") or tag == "latest":
            raise ValueError(f"checkpoint tag {tag!r} is not a usable directory name; use e.g. 'global_step100'")
        mode = self.options.tag_validation
        if mode == "Ignore" or self.comm.world_size == 1:
            return
        tags = self.comm.all_gather_object(tag)
        if len(set(tags)) > 1:
            message = f"ranks passed different checkpoint tags {sorted(set(tags))}; every rank must use the same tag"
            if mode == "Fail":
                raise ValueError(message + " (checkpoint.tag_validation = 'Fail')")
            warnings.warn(message, stacklevel=3)
