"""The durable tier: a copy of each committed checkpoint under a pyarrow.fs URI.

pyarrow.fs gives one API over file://, s3://, gs:// and hdfs://. Files are copied by a thread pool
(one file per task, pyarrow streaming each in chunks), so a checkpoint of many shards uploads in
parallel instead of one object at a time. Each rank uploads the files it wrote; the manifest and
`latest` follow only after every rank's upload finished (same commit protocol as on local disk,
[Note: commit protocol] in manifest.py).
"""
from __future__ import annotations

import posixpath
import threading
from collections.abc import Callable, Iterable

import pyarrow.fs as pafs

from rayzero.checkpoint.manifest import LATEST, MANIFEST, Manifest
from rayzero.checkpoint.storage import filesystem_from_uri
from rayzero.config.errors import RayZeroValueError

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

    def _write_text(self, path: str, text: str) -> None:
        # Write then move: a reader never sees a torn manifest (object stores PUT atomically anyway).
        with self.filesystem.open_output_stream(path + ".tmp") as writer:
            writer.write(text.encode())
        self.filesystem.move(path + ".tmp", path)

    def commit(self, manifest: Manifest) -> None:
        self._write_text(self._path(manifest.tag, MANIFEST), manifest.to_json())
        self._write_text(self._path(LATEST), manifest.tag + "\n")

    def read_manifest(self, tag: str) -> Manifest | None:
        try:
            with self.filesystem.open_input_stream(self._path(tag, MANIFEST)) as reader:
                return Manifest.from_json(reader.read().decode())
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def committed(self) -> list[Manifest]:
        """Manifests of every committed checkpoint in the durable copy, newest first."""
        try:
            infos = self.filesystem.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except OSError:
            return []
        manifests = [self.read_manifest(info.base_name) for info in infos if info.type == pafs.FileType.Directory]
        found = [manifest for manifest in manifests if manifest is not None]
        return sorted(found, key=lambda manifest: (manifest.step, manifest.created_unix), reverse=True)

    def file_sizes(self, tag: str) -> dict[str, int]:
        infos = self.filesystem.get_file_info(pafs.FileSelector(self._path(tag), allow_not_found=True))
        return {info.base_name: info.size for info in infos if info.type == pafs.FileType.File}

    def apply_retention(self, keep_last: int, owned: Callable[[Manifest], bool] | None = None) -> None:
        """Delete committed checkpoints past the newest `keep_last`, only those `owned` allows
        ([Note: retention owns only its own] in manifest.py)."""
        if keep_last <= 0:
            return
        for manifest in self.committed()[keep_last:]:
            if owned is not None and not owned(manifest):
                continue
            self.filesystem.delete_file(self._path(manifest.tag, MANIFEST))
            self.filesystem.delete_dir(self._path(manifest.tag))
