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

import logging
import posixpath
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from rayzero.checkpoint.manifest import MANIFEST, Manifest
from rayzero.checkpoint.storage import filesystem_from_uri
from rayzero.controller.status import CheckpointRecord

logger = logging.getLogger("rayzero.controller")


def _filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    uri = location if "://" in location else Path(location).resolve().as_uri()
    return filesystem_from_uri(uri)


def _read_manifest(filesystem: pafs.FileSystem, path: str) -> Manifest | None:
    try:
        with filesystem.open_input_stream(path) as reader:
            return Manifest.from_json(reader.read().decode())
    except (OSError, ValueError, KeyError, TypeError):
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


def committed_in(location: str) -> list[Found]:
    """Every committed checkpoint directly under save directory `location` (or `location` itself
    when it is one checkpoint), newest first. Unreachable locations yield nothing (logged)."""
    try:
        filesystem, root = _filesystem(location)
        own = _read_manifest(filesystem, posixpath.join(root, MANIFEST))
        if own is not None:
            parent = location.rstrip("/").rsplit("/", 1)[0]
            return [Found(CheckpointRecord(_tier(location), location, own.step, own.created_unix), parent)]
        infos = filesystem.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except (OSError, ValueError) as error:
        logger.warning("cannot list checkpoints in %s: %s", location, error)
        return []
    found = []
    for info in infos:
        if info.type != pafs.FileType.Directory:
            continue
        manifest = _read_manifest(filesystem, posixpath.join(info.path, MANIFEST))
        if manifest is not None:
            tag_location = f"{location.rstrip('/')}/{info.base_name}"
            found.append(Found(CheckpointRecord(_tier(location), tag_location, manifest.step,
                                                manifest.created_unix), location))
    found.sort(key=lambda item: (item.record.step, item.record.time), reverse=True)
    return found


def newest(locations: list[str]) -> Found | None:
    """The newest committed checkpoint over all `locations` (ties: the first location listed)."""
    best: Found | None = None
    for location in dict.fromkeys(loc for loc in locations if loc):
        for item in committed_in(location)[:1]:
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
