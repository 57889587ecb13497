"""The manifest (the commit record of a checkpoint) and the on-disk layout of a save directory.

    SAVE_DIR/
      latest                       one line: the tag of the newest committed checkpoint
      global_step100/              one directory per tag
        rank00000.safetensors      one shard file per rank (see shard_file.py)
        rank00001.safetensors
        manifest.json              written last: no manifest, no checkpoint

[Note: commit protocol]
Shard files are written under a temporary name and renamed; the manifest is written the same way
and only after every rank's files are durable (a barrier on the checkpoint process group). `latest`
is rewritten (tmp + rename) only after the manifest. A save killed at any point therefore leaves at
worst a tag directory without a manifest, which listing ignores and the next save's retention pass
deletes. With node-local storage every node holds its own copy of the tag directory (its ranks'
files plus the replicas it keeps for peers) and its own manifest; the checkpoint is complete when
the union of the nodes' copies, or the durable copy, holds every file the manifest names.

[Note: retention owns only its own]
`keep_last` deletes old checkpoints, but only ones the running job wrote: a same-name rerun of a
run (Ray Train's contract: it resumes where the earlier run stopped) must never delete the earlier
run's checkpoints, which may be the only copy of weeks of work and were kept by a setting of that
run. Each manifest records the run session that wrote it (`rayzero.fit` sets RAYZERO_RUN_SESSION
once per call, the same for every attempt of that call, so restarts after a failure still rotate
their own checkpoints); retention deletes a committed checkpoint past `keep_last` only when it is
of the saver's own session, or — outside a session — one this process committed itself. Older
checkpoints still count towards `keep_last`, so a rerun keeps its newest `keep_last` minus theirs.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from rayzero.config.errors import RayZeroValueError

FORMAT = "rayzero-checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"
RUN_SESSION_ENV = "RAYZERO_RUN_SESSION"
"""Set by `rayzero.fit` once per call: the `Manifest.run_session` of what it writes."""


def shard_file_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


@dataclass(frozen=True)
class FileEntry:
    size: int
    checksum: str
    """xxh3-128 hex digest of the whole file."""
    rank: int
    """The rank that wrote it."""
    node: str
    """The node that wrote it (where its primary copy lives with node-local storage)."""


@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of a global tensor, stored in `file` under the tensor's name."""

    file: str
    start: int
    end: int


@dataclass(frozen=True)
class TensorEntry:
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel


@dataclass
class Manifest:
    tag: str
    step: int
    world_size: int
    stage: int
    config_digest: str
    files: dict[str, FileEntry]
    tensors: dict[str, TensorEntry]
    rank_states: list[dict[str, Any]]
    """Per saved rank: node id and RNG state (see rng.py)."""
    extra_state: dict[str, Any] = field(default_factory=dict)
    """The engine's JSON-able state: steps, scheduler, loss scaler, data position."""
    client_state: dict[str, Any] = field(default_factory=dict)
    created_unix: float = field(default_factory=time.time)
    format: str = FORMAT
    run_session: str = ""
    """The run session that wrote it (one `rayzero.fit` call, RAYZERO_RUN_SESSION; "" outside one):
    retention deletes only checkpoints of its own session ([Note: retention owns only its own])."""

    def to_json(self) -> str:
        # Built by hand, not with dataclasses.asdict (which deep-copies every RNG-state integer), and
        # written compact: json's C encoder runs only without `indent`. At 4,096 ranks (~100 MB of
        # manifest) the two took the commit from tens of seconds to about one ([Note: manifest cost]).
        body: dict[str, Any] = {field.name: getattr(self, field.name) for field in fields(self)}
        body["files"] = {name: asdict(entry) for name, entry in self.files.items()}
        body["tensors"] = {
            name: {"shape": list(entry.shape), "dtype": entry.dtype,
                   "pieces": [[piece.file, piece.start, piece.end] for piece in entry.pieces]}
            for name, entry in self.tensors.items()
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        body = json.loads(text)
        if body.get("format") != FORMAT:
            raise RayZeroValueError(f"not a rayzero checkpoint manifest (format {body.get('format')!r}, expected {FORMAT!r})")
        body["files"] = {name: FileEntry(**entry) for name, entry in body["files"].items()}
        body["tensors"] = {
            name: TensorEntry(tuple(entry["shape"]), entry["dtype"],
                              tuple(Piece(*piece) for piece in entry["pieces"]))
            for name, entry in body["tensors"].items()
        }
        return cls(**body)

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())


def write_atomic(path: str, text: str) -> None:
    """Write a small text file so readers see the old or the new content, never a torn one."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _fsync_dir(path: str) -> None:
    # The rename is durable only once the directory entry is; skip where directories cannot be opened.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit(tag_dir: str, manifest: Manifest) -> None:
    write_atomic(os.path.join(tag_dir, MANIFEST), manifest.to_json())


def read_manifest(tag_dir: str) -> Manifest | None:
    """The manifest of a tag directory, or None when it was never committed or is unreadable."""
    try:
        with open(os.path.join(tag_dir, MANIFEST)) as source:
            return Manifest.from_json(source.read())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def set_latest(root: str, tag: str) -> None:
    write_atomic(os.path.join(root, LATEST), tag + "\n")


def read_latest(root: str) -> str | None:
    try:
        with open(os.path.join(root, LATEST)) as source:
            return source.read().strip() or None
    except OSError:
        return None


def committed_tags(root: str) -> list[tuple[int, str]]:
    """(step, tag) of every committed checkpoint under `root`, newest first."""
    found = []
    if not os.path.isdir(root):
        return found
    for entry in os.scandir(root):
        if entry.is_dir():
            manifest = read_manifest(entry.path)
            if manifest is not None:
                found.append((manifest.step, manifest.created_unix, entry.name))
    found.sort(reverse=True)
    return [(step, tag) for step, _, tag in found]


def apply_retention(root: str, keep_last: int, keep: set[str] = frozenset(),
                    owned: Callable[[Manifest], bool] | None = None) -> list[str]:
    """Delete all but the newest `keep_last` committed tags and every uncommitted tag directory
    except those in `keep` (a save in flight). Returns the deleted tags.

    `owned` (default: every checkpoint) says which committed checkpoints this saver may delete; the
    others count towards `keep_last` but are never deleted ([Note: retention owns only its own])."""
    committed = [tag for _, tag in committed_tags(root)]
    doomed = committed[keep_last:] if keep_last > 0 else []
    if owned is not None:
        doomed = [tag for tag in doomed if (manifest := read_manifest(os.path.join(root, tag))) and owned(manifest)]
    for entry in os.scandir(root) if os.path.isdir(root) else []:
        uncommitted = entry.is_dir() and entry.name not in committed and entry.name not in keep
        if uncommitted and any(name.endswith((".safetensors", ".tmp")) for name in os.listdir(entry.path)):
            doomed.append(entry.name)  # a save that died before its commit
    for tag in doomed:
        # Remove the manifest first so a crash halfway through deletion leaves an invisible tag.
        try:
            os.remove(os.path.join(root, tag, MANIFEST))
        except OSError:
            pass
        shutil.rmtree(os.path.join(root, tag), ignore_errors=True)
    return doomed


def resolve_tag_dir(path: str) -> str:
    """A save directory (follow `latest`, else the newest committed tag) or one tag directory."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    tag = read_latest(path)
    if tag is not None and os.path.isfile(os.path.join(path, tag, MANIFEST)):
        return os.path.join(path, tag)
    tags = committed_tags(path)
    if not tags:
        raise FileNotFoundError(f"{path} holds no committed checkpoint (no {MANIFEST} in it or below it)")
    return os.path.join(path, tags[0][1])
