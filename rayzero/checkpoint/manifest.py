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
worst a tag directory without a manifest, which listing ignores and the retention pass of the next
save of the same run deletes. With node-local storage every node holds its own copy of the tag directory (its ranks'
files plus the replicas it keeps for peers) and its own manifest; the checkpoint is complete when
the union of the nodes' copies, or the durable copy, holds every file the manifest names.

Which tag directories retention may delete: [Note: retention owns only its own] in retention.py.
Every name read back from a manifest or from `latest` is checked before it is joined into a path
([Note: names that become paths] in rayzero/config/names.py).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from rayzero.checkpoint.collector import collector_paused
from rayzero.config.errors import RayZeroError, RayZeroValueError
from rayzero.config.names import check_name, name_problem

log = logging.getLogger(__name__)

FORMAT = "rayzero-checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"


def shard_file_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


class NoCheckpointError(RayZeroError, FileNotFoundError):
    """No committed, complete and intact checkpoint was found (in any tier, for a load)."""


class NotAManifestError(RayZeroValueError):
    """A `manifest.json` that is not a rayzero manifest at all (another tool's file, not JSON)."""


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
        return math.prod(self.shape)


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
    lineage: str = ""
    """The run lineage that wrote it (for people reading it; ownership is the tag directory's
    marker, [Note: retention owns only its own] in retention.py)."""

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
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and check a manifest; anything malformed raises RayZeroValueError naming the field.
        Names that become paths (the tag, every file) are checked like user input, so a tampered
        manifest cannot point a load or a delete outside its directory."""
        try:
            body = json.loads(text)
        except (ValueError, TypeError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise NotAManifestError(f"checkpoint manifest is not JSON ({error})") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            found = body.get("format") if isinstance(body, dict) else type(body).__name__
            raise NotAManifestError(f"not a rayzero checkpoint manifest (format {found!r}, expected {FORMAT!r})")
        return _parse(body)

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())


STORED_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
"""dtype names a manifest may record (shard_file.py stores exactly these)."""


def _bad(field: str, value: Any, expected: str) -> RayZeroValueError:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return RayZeroValueError(f"checkpoint manifest: {field} = {shown} is not {expected}")


def _int(value: Any, field: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _bad(field, value, f"an integer >= {low}")
    return value


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise _bad(field, value, "a string")
    return value


def _object(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(field, value, "a JSON object")
    return value


def _array(value: Any, field: str) -> list[Any]:
    if not isinstance(value, list):
        raise _bad(field, value, "a JSON array")
    return value


def _parse(body: dict[str, Any]) -> Manifest:
    """A Manifest from its JSON body, every field checked (see Manifest.from_json)."""
    tag = check_name(body.get("tag"), "checkpoint manifest: tag")
    files = {}
    for name, entry in _object(body.get("files"), "files").items():
        check_name(name, "checkpoint manifest: a file name in `files`")
        entry = _object(entry, f"files[{name!r}]")
        files[name] = FileEntry(_int(entry.get("size"), f"files[{name!r}].size"),
                                _text(entry.get("checksum"), f"files[{name!r}].checksum"),
                                _int(entry.get("rank"), f"files[{name!r}].rank"),
                                _text(entry.get("node"), f"files[{name!r}].node"))
    tensors = {}
    for name, entry in _object(body.get("tensors"), "tensors").items():
        where = f"tensors[{name!r}]"
        entry = _object(entry, where)
        shape = tuple(_int(dim, f"{where}.shape") for dim in _array(entry.get("shape"), f"{where}.shape"))
        dtype = _text(entry.get("dtype"), f"{where}.dtype")
        if dtype not in STORED_DTYPES:
            raise _bad(f"{where}.dtype", dtype, f"one of {', '.join(STORED_DTYPES)}")
        numel = 1
        for dim in shape:
            numel *= dim
        pieces = []
        for piece in _array(entry.get("pieces"), f"{where}.pieces"):
            if not isinstance(piece, list) or len(piece) != 3:
                raise _bad(f"{where}.pieces", piece, "a [file, start, end] triple")
            file, start, end = piece
            if file not in files:
                raise _bad(f"{where}.pieces", piece, "a piece of a file listed in `files`")
            if not _int(start, f"{where}.pieces") <= _int(end, f"{where}.pieces") <= numel:
                raise _bad(f"{where}.pieces", piece, f"a range inside the tensor's {numel} elements")
            pieces.append(Piece(file, start, end))
        tensors[name] = TensorEntry(shape, dtype, tuple(pieces))
    created = body.get("created_unix", 0.0)
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        raise _bad("created_unix", created, "a number")
    return Manifest(
        tag=tag, step=_int(body.get("step"), "step"), world_size=_int(body.get("world_size"), "world_size", 1),
        stage=_int(body.get("stage"), "stage"), config_digest=_text(body.get("config_digest", ""), "config_digest"),
        files=files, tensors=tensors,
        rank_states=[_object(state, "rank_states[]") for state in _array(body.get("rank_states"), "rank_states")],
        extra_state=_object(body.get("extra_state", {}), "extra_state"),
        client_state=_object(body.get("client_state", {}), "client_state"),
        created_unix=float(created),
        # manifests written before lineages recorded the run session instead
        lineage=_text(body.get("lineage", body.get("run_session", "")), "lineage"))


def write_atomic(path: str, text: str) -> None:
    """Write a small text file so readers see the old or the new content, never a torn one."""
    publish(stage(path, text))


@dataclass(frozen=True)
class Staged:
    """A small file written (and fsynced) under a temporary name beside `path`, not yet visible."""

    tmp: str
    path: str

    def discard(self) -> None:
        _remove_quietly(self.tmp)


def stage(path: str, text: str) -> Staged:
    """The first half of write_atomic: every byte written where it will live, the name unchanged.
    What can fail for space fails here ([Note: a commit that space cannot tear] in saver.py)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        _remove_quietly(tmp)  # a full disk must not leave the temporary behind
        raise
    return Staged(tmp, path)


def publish(staged: Staged) -> None:
    """The second half: the rename that makes it visible (no data block to allocate)."""
    try:
        os.replace(staged.tmp, staged.path)
    except BaseException:
        staged.discard()
        raise
    _fsync_dir(os.path.dirname(staged.path) or ".")


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


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
    publish(stage_manifest(tag_dir, manifest))


def stage_manifest(tag_dir: str, manifest: Manifest) -> Staged:
    """The manifest written but not yet committed (`publish` commits it)."""
    with collector_paused():  # serializing N ranks' entries ([see rayzero/checkpoint/collector.py])
        text = manifest.to_json()
    return stage(os.path.join(tag_dir, MANIFEST), text)


def load_manifest(tag_dir: str) -> Manifest:
    """The manifest of a tag directory; NoCheckpointError when it has none, RayZeroValueError naming
    the file when it is unreadable or malformed (what a tool reading one checkpoint reports)."""
    path = os.path.join(tag_dir, MANIFEST)
    try:
        with open(path, "rb") as source:
            text = source.read()
    except FileNotFoundError:
        raise NoCheckpointError(f"{tag_dir} is not a committed checkpoint (no {MANIFEST})") from None
    except OSError as error:
        raise RayZeroValueError(f"{path}: cannot read it ({error.strerror or error})") from None
    try:
        return Manifest.from_json(text)
    except RayZeroValueError as error:
        raise RayZeroValueError(f"{path}: {error}") from None


def read_manifest(tag_dir: str) -> Manifest | None:
    """The manifest of a tag directory, or None when it was never committed or is unreadable."""
    try:
        with open(os.path.join(tag_dir, MANIFEST), "rb") as source:
            return Manifest.from_json(source.read())
    except (OSError, NotAManifestError):
        return None
    except RayZeroValueError as error:  # ours, but damaged or tampered with
        log.warning("ignoring %s: %s", os.path.join(tag_dir, MANIFEST), error)
        return None


def set_latest(root: str, tag: str) -> None:
    write_atomic(os.path.join(root, LATEST), tag + "\n")


def read_latest(root: str) -> str | None:
    """The tag `latest` names, or None when there is none or it is not a usable tag name."""
    try:
        with open(os.path.join(root, LATEST), "rb") as source:
            tag = source.read(1024).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if tag and name_problem(tag) is None:
        return tag
    if tag:
        log.warning("ignoring %s: it names %r, not a checkpoint tag", os.path.join(root, LATEST), tag)
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


def resolve_tag_dir(path: str) -> str:
    """A save directory (follow `latest`, else the newest committed tag) or one tag directory."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    tag = read_latest(path)
    if tag is not None and os.path.isfile(os.path.join(path, tag, MANIFEST)):
        return os.path.join(path, tag)
    tags = committed_tags(path)
    if not tags:
        raise NoCheckpointError(f"{path} holds no committed checkpoint (no {MANIFEST} in it or below it)")
    return os.path.join(path, tags[0][1])
