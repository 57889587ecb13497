"""A run's committed checkpoints, as the checkpoint layer wrote them (read through pyarrow.fs), and
what the controller makes of them: the newest one, and where a restart resumes from.

[Note: checkpoints from the checkpoint layer]
The controller never trusts what a loop reported or whether a local path exists: it lists each
location where the run's checkpoints live (the run's checkpoint directory under its storage URI,
the configured durable copy, directories loops reported) through `pyarrow.fs` — so file://, s3://,
gs:// and hdfs:// behave the same — and a checkpoint counts only when its `manifest.json` (written
last, [Note: commit protocol] in rayzero/checkpoint/manifest.py) parses. A restart resumes from the
location holding the newest one; the engine's loader then picks the newest checkpoint complete in
any tier there (node-local copies, peer replicas, the durable copy) and skips a corrupt one.

The tracker below uses only that listing: manifests at the run's locations, and, for node-local
runs, the newest checkpoint each rank's heartbeat found on its own disk ([Note: node-local runs] in
rayzero/workers/boundary.py). What a loop reported only adds a place to look.
"""
from __future__ import annotations

import json
import logging
import posixpath
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from rayzero.checkpoint.collector import collector_paused
from rayzero.checkpoint.manifest import FORMAT, MANIFEST
from rayzero.checkpoint.storage import filesystem_from_uri
from rayzero.controller.status import CheckpointRecord
from rayzero.workers.boundary import NODE_LOCAL_RESUME

logger = logging.getLogger("rayzero.controller")


def _filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    uri = location if "://" in location else Path(location).resolve().as_uri()
    return filesystem_from_uri(uri)


def _read_manifest(filesystem: pafs.FileSystem, path: str) -> tuple[int, float] | None:
    """(step, created_unix) of the manifest at `path`, or None when it does not parse as one.

    Only what the registry needs: the tensor and file tables are left as parsed JSON, not turned into
    objects (the loader reads the whole manifest when it loads the checkpoint)."""
    try:
        with filesystem.open_input_stream(path) as reader:
            text = reader.read()
        with collector_paused():  # the parsed JSON is freed inside too: no collection walks it after
            return _summary(text)
    except OSError:
        return None


def _summary(text: bytes) -> tuple[int, float] | None:
    try:
        body = json.loads(text)
        if body.get("format") != FORMAT:
            return None
        return int(body["step"]), float(body.get("created_unix", 0.0))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _tier(location: str) -> str:
    # Everything the controller lists is reachable from its node: the run's storage or the durable
    # copy. Node-local copies and peer replicas live on the workers' disks; the engine's loader
    # reaches them (rayzero/checkpoint/loader.py).
    return "durable"


@dataclass(frozen=True)
class Found:
    record: CheckpointRecord
    root: str
    """The save directory holding it (what `engine.load_checkpoint(root)` takes)."""


class ManifestCache:
    """What manifests already read said, so a listing reads only new ones ([Note: registry scans]).

    [Note: registry scans]
    A manifest records every rank's shard and RNG state: about 20 kB per rank, so ~90 MB at 4,096
    ranks, and parsing one takes seconds. The controller lists the run's locations every
    `checkpoint_scan_interval_s`, twice per failure (the newest checkpoint, then where to resume)
    and per boundary request. A committed manifest never changes in place: it is written once by an
    atomic rename, and re-saving a tag deletes and rewrites it ([Note: commit protocol] in
    rayzero/checkpoint/manifest.py). So a manifest whose size and modification time are unchanged
    says what it said before; each listing costs one listing plus one metadata call, and each
    checkpoint is parsed once. Entries of tags that disappeared (retention) are dropped per listing.
    The parse itself runs with the cyclic garbage collector paused: the millions of containers it
    makes set off collections that walk every object made so far, which made a parse grow faster
    than the manifest (bench/scale.py: 0.59 s of CPU at 4,096 ranks, N^1.2; paused 0.35 s, linear).
    The parsed JSON holds no cycles; refcounting frees it as before.
    """

    def __init__(self) -> None:
        self._seen: dict[str, dict[str, tuple[tuple[int, int | None], tuple[int, float] | None]]] = {}
        self.reads = 0  # manifests parsed so far (listings that hit the cache parse none)

    def summaries(self, filesystem: pafs.FileSystem, directory: str, paths: list[str]
                  ) -> dict[str, tuple[int, float] | None]:
        """path -> (step, created) for each manifest among `paths` (under `directory`) that exists."""
        before = self._seen.get(directory, {})
        now: dict[str, tuple[tuple[int, int | None], tuple[int, float] | None]] = {}
        for info in filesystem.get_file_info(paths) if paths else []:
            if info.type != pafs.FileType.File:
                continue
            key = (info.size, info.mtime_ns)
            known = before.get(info.path)
            if known is None or known[0] != key or key[1] is None:
                self.reads += 1
                known = (key, _read_manifest(filesystem, info.path))
            now[info.path] = known
        self._seen[directory] = now
        return {path: summary for path, (_, summary) in now.items()}


def committed_in(location: str, cache: ManifestCache | None = None) -> list[Found]:
    """Every committed checkpoint directly under save directory `location` (or `location` itself
    when it is one checkpoint), newest first. Unreachable locations yield nothing (logged).
    `cache`: manifests already read by earlier listings ([Note: registry scans])."""
    cache = cache if cache is not None else ManifestCache()
    try:
        filesystem, root = _filesystem(location)
        own_path = posixpath.join(root, MANIFEST)
        own = cache.summaries(filesystem, own_path, [own_path]).get(own_path)
        if own is not None:
            parent = location.rstrip("/").rsplit("/", 1)[0]
            return [Found(CheckpointRecord(_tier(location), location, own[0], own[1]), parent)]
        infos = filesystem.get_file_info(pafs.FileSelector(root, allow_not_found=True))
        directories = [info for info in infos if info.type == pafs.FileType.Directory]
        summaries = cache.summaries(filesystem, root, [posixpath.join(info.path, MANIFEST) for info in directories])
    except (OSError, ValueError) as error:
        logger.warning("cannot list checkpoints in %s: %s", location, error)
        return []
    found = []
    for info in directories:
        summary = summaries.get(posixpath.join(info.path, MANIFEST))
        if summary is not None:
            tag_location = f"{location.rstrip('/')}/{info.base_name}"
            found.append(Found(CheckpointRecord(_tier(location), tag_location, summary[0], summary[1]), location))
    found.sort(key=lambda item: (item.record.step, item.record.time), reverse=True)
    return found


def newest(locations: list[str], cache: ManifestCache | None = None) -> Found | None:
    """The newest committed checkpoint over all `locations` (ties: the first location listed)."""
    best: Found | None = None
    for location in dict.fromkeys(loc for loc in locations if loc):
        for item in committed_in(location, cache)[:1]:
            if best is None or item.record.step > best.record.step:
                best = item
    return best


def newest_per_tier(locations: list[str]) -> tuple[CheckpointRecord, ...]:
    """The newest committed checkpoint of each tier among `locations`."""
    per_tier: dict[str, CheckpointRecord] = {}
    for location in dict.fromkeys(loc for loc in locations if loc):
        for item in committed_in(location)[:1]:
            current = per_tier.get(item.record.tier)
            if current is None or item.record.step > current.step:
                per_tier[item.record.tier] = item.record
    return tuple(per_tier.values())


# ---- the tracker: the newest committed checkpoint of one run, across attempts -----------------

def _parent(location: str) -> str:
    """The directory holding `location` (`.../run/global_step7` -> `.../run`); itself at a root."""
    return location.rstrip("/").rpartition("/")[0] or location


def _save_directory(location: str) -> str:
    """The save directory of a reported tag directory (`.../global_stepN` -> `...`)."""
    return _parent(location) if location.rstrip("/").rpartition("/")[2].startswith("global_step") else location


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
        # the save directory of the newest checkpoint a heartbeat named outside the run's own directory
        # (a script's choice, such as an HF Trainer's checkpoint-N): listed like a reported one
        self._heartbeat_dir: str | None = None
        self.manifests = ManifestCache()  # each manifest parsed once ([Note: registry scans])

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
            # a heartbeat names the tag directory engine.save_checkpoint(save_dir, tag) wrote, whatever
            # the tag (global_stepN; RayZeroStrategy's `checkpoint`): its save directory is its parent
            self._heartbeat_dir = _parent(committed[1])

    def locations(self) -> list[str]:
        """Where to list: the configured locations, then each reported tag directory's save directory,
        then the one of the newest checkpoint a heartbeat named."""
        return list(self._locations) + list(self.reported) + ([self._heartbeat_dir] if self._heartbeat_dir else [])

    def refresh(self) -> CheckpointRecord | None:
        """List the locations again; the newest committed checkpoint known afterwards."""
        self._look_past_heartbeat()
        found = newest(self.locations(), self.manifests)
        if found is not None and (self.latest is None or found.record.step >= self.latest.step):
            self.latest = found.record
        return self.latest

    def resume_location(self) -> str | None:
        """What the next attempt resumes from: the save directory holding the newest committed
        checkpoint, NODE_LOCAL_RESUME for node-local runs, None when there is none."""
        self._look_past_heartbeat()
        found = newest(self.locations(), self.manifests)
        if self._node_local:
            # Each new rank resumes from its own node's directory; the loader there takes the newest
            # checkpoint complete over the survivors' copies, peer replicas and the durable copy —
            # including one committed after the last heartbeat ([Note: node-local runs]).
            on_disk = self._from_heartbeats
            if on_disk is not None and (found is None or on_disk.step >= found.record.step):
                self.latest = on_disk
            return NODE_LOCAL_RESUME
        if found is None:
            return None
        self.latest = found.record
        return found.root

    def _look_past_heartbeat(self) -> None:
        """Follow a script's numbered save directories past the one the last heartbeat named
        ([Note: saves after the last heartbeat])."""
        if self._heartbeat_dir is None or self.latest is None:
            return
        for sibling in numbered_siblings(self._heartbeat_dir):
            found = committed_in(sibling, self.manifests)
            if found and found[0].record.step > self.latest.step:
                self._heartbeat_dir = sibling
                return

    def record_of(self, location: str, step: int) -> CheckpointRecord:
        """The record of the checkpoint the ranks just committed at `location` (a tag directory)."""
        for item in committed_in(location, self.manifests):
            self.latest = item.record
            return item.record
        return CheckpointRecord("durable", location, step, time.time())


_NUMBER = re.compile(r"\d+")


def _numbering(name: str) -> tuple[str, tuple[int, ...]] | None:
    """(the name with each number as '#', its numbers), None for a name without one:
    `checkpoint-500` -> ('checkpoint-#', (500,)), `epoch=3-step=200.ckpt` -> ('epoch=#-step=#.ckpt', (3, 200))."""
    numbers = tuple(int(found) for found in _NUMBER.findall(name))
    return (_NUMBER.sub("#", name), numbers) if numbers else None


def numbered_siblings(save_dir: str) -> list[str]:
    """The directories beside `save_dir` named like it with larger numbers (`checkpoint-500` ->
    `checkpoint-1000`, `checkpoint_3` -> `checkpoint_4`, `epoch=1-step=100.ckpt` ->
    `epoch=3-step=200.ckpt`), largest first; [] when its name holds no number or its parent cannot be
    listed.

    [Note: saves after the last heartbeat]
    A script that picks its own save directories (an HF Trainer's `output_dir/checkpoint-N`,
    Accelerate's `checkpoints/checkpoint_N`, a Lightning ModelCheckpoint's `epoch=E-step=S.ckpt`) makes
    a new one per save; the controller learns of it from the next heartbeat ([Note: node-local runs]
    in rayzero/workers/boundary.py). A rank killed between a save's commit and that heartbeat leaves a
    committed checkpoint the controller has not heard of, and the script's restart resumes from it (the
    Trainer takes its newest complete `checkpoint-N`, rayzero/compat/trainer.py; RayZeroStrategy its
    ModelCheckpoint directory's newest, [Note: Lightning restarts]). So at a failure the tracker lists
    the parent of the newest save directory a heartbeat named for siblings with its name but larger
    numbers (every counter in a save's name, epoch and step alike, only grows: compared as a tuple) and
    takes the largest one holding a committed checkpoint newer than the one known: what the run says
    it resumed from, and what goodput counts as redone, is then the step the script resumed from. A
    kill before any heartbeat named one of the script's saves still goes unseen (the controller does
    not know where the script saves).
    It does so at each listing (a failure, `checkpoint_scan_interval_s`): one listing of the parent,
    plus one per newer sibling up to the first committed one (usually none: the heartbeat names it).
    """
    parent, _, name = save_dir.rstrip("/").rpartition("/")
    ours = _numbering(name)
    if not parent or ours is None:
        return []
    try:
        filesystem, root = _filesystem(parent)
        infos = filesystem.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except (OSError, ValueError) as error:
        logger.warning("cannot list %s for checkpoints newer than %s: %s", parent, name, error)
        return []
    numbered = []
    for info in infos:
        other = _numbering(info.base_name)
        if info.type == pafs.FileType.Directory and other and other[0] == ours[0] and other[1] > ours[1]:
            numbered.append((other[1], f"{parent}/{info.base_name}"))
    return [path for _, path in sorted(numbered, reverse=True)]
