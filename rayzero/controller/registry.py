"""The committed checkpoints of a run, as the checkpoint layer wrote them, read through pyarrow.fs.

[Note: checkpoints from the checkpoint layer]
The controller never trusts what a loop reported or whether a local path exists: it lists each
location where the run's checkpoints live (the run's checkpoint directory under its storage URI,
the configured durable copy, directories loops reported) through `pyarrow.fs` — so file://, s3://,
gs:// and hdfs:// behave the same — and a checkpoint counts only when its `manifest.json` (written
last, [Note: commit protocol] in rayzero/checkpoint/manifest.py) parses. A restart resumes from the
location holding the newest one; the engine's loader then picks the newest checkpoint complete in
any tier there (node-local copies, peer replicas, the durable copy) and skips a corrupt one.
"""
from __future__ import annotations

import json
import logging
import posixpath
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from rayzero.checkpoint.manifest import FORMAT, MANIFEST
from rayzero.checkpoint.storage import filesystem_from_uri
from rayzero.controller.status import CheckpointRecord

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
            body = json.loads(reader.read())
        if body.get("format") != FORMAT:
            return None
        return int(body["step"]), float(body.get("created_unix", 0.0))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
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
