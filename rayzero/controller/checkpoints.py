"""What the controller knows about a run's committed checkpoints, and where a restart resumes from.

Everything here comes from the checkpoint layer itself ([Note: checkpoints from the checkpoint
layer] in registry.py): manifests listed through pyarrow.fs at the run's locations, and, for
node-local runs, the newest checkpoint each rank's heartbeat found on its own disk ([Note:
node-local runs] in rayzero/workers/boundary.py). What a loop reported only adds a place to look.
"""
from __future__ import annotations

import time

from rayzero.controller import registry
from rayzero.controller.status import CheckpointRecord
from rayzero.workers.boundary import NODE_LOCAL_RESUME


def _save_directory(location: str) -> str:
    """The save directory of a reported tag directory (`.../global_stepN` -> `...`)."""
    parent, _, last = location.rstrip("/").rpartition("/")
    return parent if last.startswith("global_step") else location


class CheckpointTracker:
    """The newest committed checkpoint of one run, across attempts."""

    def __init__(self, locations: tuple[str, ...], node_local: bool) -> None:
        self._locations = locations  # the run's checkpoint directory and durable copy (from fit)
        self._node_local = node_local  # checkpoints live on the workers' disks
        # save directories of the checkpoints loops attached to reports, in order: one entry per
        # directory, not per checkpoint, so listing costs the same at step 100 and step 100,000
        self.reported: dict[str, None] = {}
        self.latest: CheckpointRecord | None = None  # the newest known, for Result and status()
        self._from_heartbeats: CheckpointRecord | None = None  # newest a rank's heartbeat found on its disk
        self.manifests = registry.ManifestCache()  # each manifest parsed once ([Note: registry scans])

    def note_reported(self, location: str) -> None:
        self.reported[_save_directory(location)] = None

    def note_heartbeat(self, committed: tuple[int, str] | None) -> None:
        """A rank's heartbeat named the newest checkpoint committed in its checkpoint directory: the
        node's disk for node-local runs, else the run's own directory when it is a local path. So
        `status()` sees a loop's own saves as they commit, not only at the end of an attempt."""
        if committed is None:
            return
        if self._node_local:
            if self._from_heartbeats is None or committed[0] > self._from_heartbeats.step:
                self._from_heartbeats = CheckpointRecord("node_local", committed[1], committed[0], time.time())
                self.latest = self._from_heartbeats
        elif self.latest is None or committed[0] > self.latest.step:
            self.latest = CheckpointRecord("durable", committed[1], committed[0], time.time())

    def locations(self) -> list[str]:
        """Where to list: the configured locations, then each reported tag directory's save directory."""
        return list(self._locations) + list(self.reported)

    def refresh(self) -> CheckpointRecord | None:
        """List the locations again; the newest committed checkpoint known afterwards."""
        found = registry.newest(self.locations(), self.manifests)
        if found is not None and (self.latest is None or found.record.step >= self.latest.step):
            self.latest = found.record
        return self.latest

    def resume_location(self) -> str | None:
        """What the next attempt resumes from: the save directory holding the newest committed
        checkpoint, NODE_LOCAL_RESUME for node-local runs, None when there is none."""
        found = registry.newest(self.locations(), self.manifests)
        if self._node_local:
            # Each new rank resumes from its own node's directory; the loader there takes the newest
            # checkpoint complete over the survivors' copies, peer replicas and the durable copy —
            # including one committed after the last heartbeat ([Note: node-local runs]).
            newest = self._from_heartbeats
            if newest is not None and (found is None or newest.step >= found.record.step):
                self.latest = newest
            return NODE_LOCAL_RESUME
        if found is None:
            return None
        self.latest = found.record
        return found.root

    def record_of(self, location: str, step: int) -> CheckpointRecord:
        """The record of the checkpoint the ranks just committed at `location` (a tag directory)."""
        for item in registry.committed_in(location, self.manifests):
            self.latest = item.record
            return item.record
        return CheckpointRecord("durable", location, step, time.time())
