"""Who owns a checkpoint directory, and `keep_last`: rayzero deletes only what its own run wrote.

[Note: retention owns only its own]
A save directory is shared ground: a user's own files may sit next to the checkpoints, a same-name
rerun resumes (and rotates) the checkpoints of the run before it, and another run may write into the
same directory. Retention must never delete anything it cannot prove it wrote, and it never decides
by file name or extension (a user's `model.safetensors` looks like a shard). The proof, in the manner
of Kubernetes' ownerReferences (an owner UID on every object the controller made, never its name):
  - every run has a *lineage*, a random id. `rayzero.fit` keeps it in `<storage>/<name>/lineage.json`,
    made by the first invocation of that name and read by every later one (RAYZERO_RUN_LINEAGE on
    the workers), so same-name reruns, restarts and Kubernetes attempts are one lineage, and another
    run (another name) is another. Outside `fit` (a script under torchrun) the lineage is one per
    engine, chosen by rank 0 at the first save or load (`CheckpointSaver.lineage`).
  - before the first byte of any shard, the leader of each storage location writes
    `<tag>/rayzero-owner.json` naming the lineage (the durable copy gets one too, before any upload);
    a tag directory that exists without marker or manifest and is not empty is someone else's, and a
    save into it is refused (`claim_tag_dir`).
  - retention looks only at tag directories whose marker names its own lineage: it keeps the newest
    `keep_last` committed ones of the lineage, across all its invocations, and removes the rest and
    any of its own saves that died before their commit. Other lineages' checkpoints neither count
    nor get deleted; a directory without a marker (a user's, or a checkpoint from a rayzero before
    markers) is never touched.
  - deleting a tag directory removes the files rayzero writes there (the manifest first, so a crash
    halfway leaves an uncommitted directory, then shards, temporaries, the marker) and then the
    directory only if nothing else is left in it: a file a user dropped inside survives, with a warning.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable

from rayzero.checkpoint.manifest import MANIFEST, read_manifest, write_atomic
from rayzero.checkpoint.storage import filesystem_from_uri
from rayzero.config.errors import RayZeroValueError

log = logging.getLogger(__name__)

OWNER_FILE = "rayzero-owner.json"
OWNER_FORMAT = "rayzero-owner/1"
LINEAGE_FILE = "lineage.json"
"""In a run directory: the run's lineage, shared by every invocation of that run name."""
LINEAGE_FORMAT = "rayzero-lineage/1"

# Every file rayzero writes inside a tag directory (shards and their temporaries, the manifest and
# its temporary, the owner marker and its temporary); nothing else is deleted from one.
_OWN_FILE = re.compile(
    r"rank\d{5,}\.safetensors(\.tmp|\.part|\.corrupt)?"
    rf"|{re.escape(MANIFEST)}(\.tmp\d*)?|{re.escape(OWNER_FILE)}(\.tmp\d*)?")


class ForeignDirectoryError(RayZeroValueError):
    """A checkpoint directory exists, holds files, and rayzero did not write it."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"{path} already exists and was not written by rayzero (no {OWNER_FILE} or {MANIFEST} "
                         "in it): refusing to write a checkpoint into it, since retention would later delete it. "
                         "Move it away, or save under another tag or save_dir")

    def __reduce__(self):
        return (type(self), (self.path,))


def new_lineage() -> str:
    return uuid.uuid4().hex


def claim_run_lineage(run_uri: str) -> str:
    """The lineage of the run at `run_uri` (`<storage>/<name>`): read from its `lineage.json`, or
    made and written there by the run's first invocation ([Note: retention owns only its own]).
    An unreadable file is never overwritten: this invocation then gets a lineage of its own, so
    it deletes none of the run's earlier checkpoints."""
    import pyarrow.fs as pafs

    filesystem, path = filesystem_from_uri(run_uri)
    marker = f"{path.rstrip('/')}/{LINEAGE_FILE}"
    if filesystem.get_file_info(marker).type == pafs.FileType.NotFound:
        lineage = new_lineage()
        filesystem.create_dir(path, recursive=True)
        with filesystem.open_output_stream(marker) as writer:
            writer.write(json.dumps({"format": LINEAGE_FORMAT, "lineage": lineage, "created_unix": time.time()},
                                    sort_keys=True).encode() + b"\n")
        return lineage
    try:
        with filesystem.open_input_stream(marker) as reader:
            body = json.loads(reader.read(4096))
        if isinstance(body, dict) and body.get("format") == LINEAGE_FORMAT and isinstance(body.get("lineage"), str):
            return body["lineage"]
        problem = "it is not a rayzero lineage file"
    except (OSError, ValueError) as error:
        problem = str(error)
    log.warning("cannot read the run's lineage from %s (%s): this invocation keeps every earlier checkpoint "
                "of the run", marker, problem)
    return new_lineage()


def is_own_file(name: str) -> bool:
    """A file name rayzero writes inside a tag directory."""
    return _OWN_FILE.fullmatch(name) is not None


def is_marker_temporary(name: str) -> bool:
    """The name of the owner marker's temporary (`.tmp<pid>` on local disk, `.tmp` in durable storage)."""
    suffix = name.removeprefix(f"{OWNER_FILE}.tmp")
    return suffix != name and (suffix == "" or suffix.isdigit())


def owner_text(lineage: str) -> str:
    return json.dumps({"format": OWNER_FORMAT, "lineage": lineage, "created_unix": time.time(),
                       "pid": os.getpid()}, sort_keys=True) + "\n"


def parse_owner(text: str | bytes) -> str | None:
    """The lineage an owner marker names, or None when it is not one (never raises)."""
    try:
        body = json.loads(text)
    except (ValueError, TypeError):
        return None
    if not isinstance(body, dict) or body.get("format") != OWNER_FORMAT:
        return None
    lineage = body.get("lineage")
    return lineage if isinstance(lineage, str) and lineage else None


def owner_of(tag_dir: str) -> str | None:
    """The lineage that owns a local tag directory, or None (no readable marker: not provably ours)."""
    text = _read_head(os.path.join(tag_dir, OWNER_FILE))
    return parse_owner(text) if text is not None else None


def claim_tag_dir(tag_dir: str, lineage: str, take_over: bool = True) -> None:
    """Make `tag_dir` this lineage's before any shard byte is written into it.

    A new directory gets the marker. An existing one is refused (ForeignDirectoryError) unless it is
    rayzero's (marker or manifest) or empty. `take_over`: a save rewrites the marker (it is about to
    replace the content); a load fetching missing files into a rayzero directory leaves it as it is.
    Raises OSError when the disk refuses (full, read-only)."""
    try:
        os.makedirs(tag_dir)
        present = []
    except FileExistsError:
        if not os.path.isdir(tag_dir) or os.path.islink(tag_dir):
            raise ForeignDirectoryError(tag_dir) from None
        present = os.listdir(tag_dir)
    owner = owner_of(tag_dir) if present else None
    torn: list[str] = []
    if present and owner is None and MANIFEST not in present:
        torn = torn_marker(present, lambda name: _read_head(os.path.join(tag_dir, name)))
        if not torn:
            raise ForeignDirectoryError(tag_dir)
    if not present or (take_over and owner != lineage):
        write_atomic(os.path.join(tag_dir, OWNER_FILE), owner_text(lineage))
        for name in torn:  # the killed save's temporaries; the marker just published replaces them
            with contextlib.suppress(OSError):
                os.remove(os.path.join(tag_dir, name))


def torn_marker(present: Iterable[str], read: Callable[[str], bytes | None]) -> list[str]:
    """`present` (a tag directory's names, no marker or manifest among them) when they are nothing but
    temporaries of rayzero's own marker, one of them (`read` by name) a whole marker: a save or upload
    killed after it made the directory and before it published the marker (the marker comes before
    any shard byte, so nothing else can be there). That directory is rayzero's, to take over; any
    other is not, and [] says so. Seen in a full test run: a rank SIGKILLed between the two left
    `rayzero-owner.json.tmp<pid>`, and the restarted run's save of that step was refused as foreign."""
    names = list(present)
    if not all(is_marker_temporary(name) for name in names):
        return []
    return names if any(parse_owner(text) for text in map(read, names) if text is not None) else []


def _read_head(path: str) -> bytes | None:
    try:
        with open(path, "rb") as source:
            return source.read(4096)
    except OSError:
        return None


def remove_tag_dir(tag_dir: str) -> None:
    """Remove what rayzero wrote in a tag directory this lineage owns ([Note: retention owns only its own])."""
    try:  # uncommit first: a crash halfway leaves an uncommitted directory, never a torn checkpoint
        os.remove(os.path.join(tag_dir, MANIFEST))
    except FileNotFoundError:
        pass
    names = sorted(os.listdir(tag_dir), key=lambda name: name == OWNER_FILE)  # the marker goes last
    for name in names:
        path = os.path.join(tag_dir, name)
        if is_own_file(name) and not os.path.isdir(path):
            os.remove(path)
    try:
        os.rmdir(tag_dir)
    except OSError:
        log.warning("kept %s: it holds files rayzero did not write (%s)", tag_dir, sorted(os.listdir(tag_dir)))


def apply_retention(root: str, keep_last: int, lineage: str, keep: frozenset[str] | set[str] = frozenset()
                    ) -> list[str]:
    """Keep the newest `keep_last` committed checkpoints of `lineage` under `root` (0: all), remove
    its older ones and its uncommitted tag directories except those in `keep` (a save in flight).
    Nothing another lineage or a user wrote is looked at twice. Returns the removed tags."""
    committed, uncommitted = [], []
    for entry in os.scandir(root) if os.path.isdir(root) else []:
        if not entry.is_dir(follow_symlinks=False) or owner_of(entry.path) != lineage:
            continue
        manifest = read_manifest(entry.path)
        if manifest is not None:
            committed.append((manifest.step, manifest.created_unix, entry.name))
        elif entry.name not in keep:
            uncommitted.append(entry.name)  # a save of ours that died before its commit
    committed.sort(reverse=True)
    doomed = [tag for _, _, tag in committed[keep_last:]] if keep_last > 0 else []
    doomed += uncommitted
    for tag in doomed:
        try:
            remove_tag_dir(os.path.join(root, tag))
        except OSError as error:  # retention must never fail a save
            log.warning("could not remove old checkpoint %s: %s", os.path.join(root, tag), error)
    return doomed
