"""The durable tier: a copy of each committed checkpoint under a pyarrow.fs URI.

pyarrow.fs gives one API over file://, s3://, gs:// and hdfs://. Files are copied by a thread pool
(one file per task, pyarrow streaming each in chunks), so a checkpoint of many shards uploads in
parallel instead of one object at a time. Each rank uploads the files it wrote; the manifest and
`latest` follow only after every rank's upload finished (same commit protocol as on local disk,
[Note: commit protocol] in manifest.py).
"""
from __future__ import annotations

import logging
import posixpath
import threading
from collections.abc import Callable, Iterable

import pyarrow.fs as pafs

from rayzero.checkpoint.manifest import LATEST, MANIFEST, Manifest, NotAManifestError
from rayzero.checkpoint.retention import (
    OWNER_FILE,
    ForeignDirectoryError,
    is_own_file,
    owner_text,
    parse_owner,
    torn_marker,
)
from rayzero.checkpoint.storage import filesystem_from_uri
from rayzero.config.errors import RayZeroValueError
from rayzero.config.names import name_problem

log = logging.getLogger(__name__)

_CHUNK = 16 << 20


def run_in_threads(tasks: list[Callable[[], None]], threads: int, name: str) -> None:
    """Run the tasks on up to `threads` plain threads; re-raise the first failure.

    Not a concurrent.futures pool: those refuse new work once the interpreter starts shutting
    down, which is exactly when an unwaited async save may still be uploading (the interpreter
    joins the save thread after that point; [Note: async save completion] in saver.py)."""
    pending = list(reversed(tasks))
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not pending or errors:
                    return
                task = pending.pop()
            try:
                task()
            except BaseException as error:  # noqa: BLE001 - re-raised in the caller below
                with lock:
                    errors.append(error)

    workers = [threading.Thread(target=work, name=f"{name}-{index}") for index in range(max(1, min(threads, len(tasks))))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]


class DurableStore:
    def __init__(self, uri: str, threads: int = 8) -> None:
        try:
            self.filesystem, self.root = filesystem_from_uri(uri)
        except Exception as error:  # pyarrow raises ArrowInvalid / OSError subclasses
            raise RayZeroValueError(f"checkpoint.durable_uri = {uri!r} is not a usable pyarrow.fs URI ({error}); "
                             "use file:///abs/path, s3://bucket/prefix, gs://bucket/prefix or hdfs://...") from error
        self.uri = uri
        self.threads = threads
        self.local = pafs.LocalFileSystem()

    def _path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def upload(self, tag: str, local_files: Iterable[tuple[str, str]]) -> None:
        """Copy (local_path, file_name) pairs into TAG/ in parallel."""
        self.filesystem.create_dir(self._path(tag), recursive=True)
        tasks = [lambda local_path=local_path, name=name: self._copy(self.local, local_path, self.filesystem,
                                                                     self._path(tag, name))
                 for local_path, name in local_files]
        run_in_threads(tasks, self.threads, "rayzero-upload")

    def download(self, tag: str, name: str, local_path: str) -> None:
        self._copy(self.filesystem, self._path(tag, name), self.local, local_path + ".part")
        self.local.move(local_path + ".part", local_path)

    @staticmethod
    def _copy(source_fs: pafs.FileSystem, source: str, target_fs: pafs.FileSystem, target: str) -> None:
        with source_fs.open_input_stream(source) as reader, target_fs.open_output_stream(target) as writer:
            while chunk := reader.read(_CHUNK):
                writer.write(chunk)

    def location(self, *parts: str) -> str:
        """The URI of a path in the durable copy, for messages."""
        return posixpath.join(self.uri.rstrip("/"), *parts)

    def _write_text(self, path: str, text: str) -> None:
        # Write then move: a reader never sees a torn manifest (object stores PUT atomically anyway).
        self._stage(path, text)
        try:
            self.filesystem.move(path + ".tmp", path)
        except BaseException:
            self._delete_quietly(path + ".tmp")
            raise

    def _stage(self, path: str, text: str) -> None:
        """`text` written at `path`.tmp (removed again if the write fails)."""
        try:
            with self.filesystem.open_output_stream(path + ".tmp") as writer:
                writer.write(text.encode())
        except BaseException:
            self._delete_quietly(path + ".tmp")
            raise

    def _delete_quietly(self, path: str) -> None:
        try:
            self.filesystem.delete_file(path)
        except OSError:
            pass

    def _read_small(self, path: str) -> bytes | None:
        try:
            with self.filesystem.open_input_stream(path) as reader:
                return reader.read(1 << 26)
        except OSError:
            return None

    def _names(self, tag: str = "") -> dict[str, pafs.FileType]:
        """Base name -> type of what lies directly under the root (or under `tag`)."""
        selector = pafs.FileSelector(self._path(tag) if tag else self.root, allow_not_found=True)
        return {info.base_name: info.type for info in self.filesystem.get_file_info(selector)}

    def owner(self, tag: str) -> str | None:
        """The lineage whose marker the durable `tag` holds ([Note: retention owns only its own])."""
        text = self._read_small(self._path(tag, OWNER_FILE))
        return parse_owner(text) if text is not None else None

    def claim(self, tag: str, lineage: str) -> None:
        """Mark the durable `tag` as this lineage's before any upload into it; refuse a directory
        holding files rayzero did not write (ForeignDirectoryError)."""
        present = self._names(tag)
        torn = []
        if present and OWNER_FILE not in present and MANIFEST not in present:
            # only the temporary of our own marker: an upload killed between staging and moving it
            # (claim_tag_dir's rule for local disk)
            torn = torn_marker(present, lambda name: self._read_small(self._path(tag, name)))
            if not torn:
                raise ForeignDirectoryError(self.location(tag))
        if self.owner(tag) != lineage:
            self.filesystem.create_dir(self._path(tag), recursive=True)
            self._write_text(self._path(tag, OWNER_FILE), owner_text(lineage))
        for name in torn:
            self._delete_quietly(self._path(tag, name))

    def discard(self, tag: str, lineage: str) -> None:
        """Remove the durable `tag` if this lineage owns it: the manifest first, then every file
        rayzero writes, the marker last, the directory only if nothing else is left. Never raises."""
        try:
            if self.owner(tag) != lineage:
                return
            self._delete_quietly(self._path(tag, MANIFEST))
            names = sorted(self._names(tag).items(), key=lambda item: item[0] == OWNER_FILE)
            for name, kind in names:
                if kind == pafs.FileType.File and is_own_file(name):
                    self.filesystem.delete_file(self._path(tag, name))
            if not self._names(tag):
                self.filesystem.delete_dir(self._path(tag))
            else:
                log.warning("kept %s: it holds files rayzero did not write", self.location(tag))
        except OSError as error:
            log.warning("could not remove %s: %s", self.location(tag), error)

    def commit(self, manifest: Manifest) -> None:
        """[Note: a commit that space cannot tear] in saver.py: the manifest and `latest` are both
        written under temporary names first (what a full disk or a quota refuses is refused there,
        before anything is visible), then moved into place, the manifest (the commit) first. A
        manifest once visible stays: a `latest` that cannot be moved after it is left naming the
        previous checkpoint, and said (readers list manifests; `latest` is for people and tools)."""
        manifest_path, latest_path = self._path(manifest.tag, MANIFEST), self._path(LATEST)
        self._stage(manifest_path, manifest.to_json())
        try:
            self._stage(latest_path, manifest.tag + "\n")
            self.filesystem.move(manifest_path + ".tmp", manifest_path)
        except BaseException:
            self._delete_quietly(manifest_path + ".tmp")
            self._delete_quietly(latest_path + ".tmp")
            raise
        try:
            self.filesystem.move(latest_path + ".tmp", latest_path)
        except OSError as error:
            self._delete_quietly(latest_path + ".tmp")
            log.warning("the durable copy of %s is committed, but %s could not be moved into place (%s): it "
                        "still names the previous checkpoint", manifest.tag, self.location(LATEST), error)

    def read_manifest(self, tag: str) -> Manifest | None:
        text = self._read_small(self._path(tag, MANIFEST))
        if text is None:
            return None
        try:
            return Manifest.from_json(text)
        except NotAManifestError:
            return None
        except RayZeroValueError as error:  # ours, damaged or tampered with
            log.warning("ignoring %s: %s", self.location(tag, MANIFEST), error)
            return None

    def _tags(self) -> list[str]:
        """Tag directories under the root (names that could not be tags are skipped)."""
        try:
            names = self._names()
        except OSError:
            return []
        return [name for name, kind in names.items() if kind == pafs.FileType.Directory and name_problem(name) is None]

    def committed(self) -> list[tuple[str, Manifest]]:
        """(tag, manifest) of every committed checkpoint in the durable copy, newest first. The tag is
        the directory's name, never what the manifest says ([Note: names that become paths])."""
        found = [(tag, manifest) for tag in self._tags() if (manifest := self.read_manifest(tag)) is not None]
        return sorted(found, key=lambda item: (item[1].step, item[1].created_unix), reverse=True)

    def file_sizes(self, tag: str) -> dict[str, int]:
        infos = self.filesystem.get_file_info(pafs.FileSelector(self._path(tag), allow_not_found=True))
        return {info.base_name: info.size for info in infos if info.type == pafs.FileType.File}

    def apply_retention(self, keep_last: int, lineage: str, keep: frozenset[str] | set[str] = frozenset()) -> None:
        """The same rule as on local disk ([Note: retention owns only its own] in retention.py): keep the
        newest `keep_last` committed checkpoints of `lineage`, remove its older and its uncommitted
        ones (except `keep`), never look at another lineage's or a user's."""
        committed, uncommitted = [], []
        for tag in self._tags():
            if self.owner(tag) != lineage:
                continue
            manifest = self.read_manifest(tag)
            if manifest is not None:
                committed.append((manifest.step, manifest.created_unix, tag))
            elif tag not in keep:
                uncommitted.append(tag)
        committed.sort(reverse=True)
        doomed = [tag for _, _, tag in committed[keep_last:]] if keep_last > 0 else []
        for tag in doomed + uncommitted:
            self.discard(tag, lineage)
