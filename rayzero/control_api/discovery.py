"""`<storage>/<run name>/control.json`: how a client finds a live run's control service.

The controller writes it when its service is up and removes it when the run ends. It holds what a
client needs to find and verify the service (address, TLS name, the CA and its fingerprint) and never
the run's bearer token ([Note: the control token never goes to run storage] in tokens.py): storage
may be a bucket without access control. Written through `pyarrow.fs` like every other file of a run,
so s3:// / gs:// runs are found from anywhere that can read the storage.
"""
from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rayzero.config.environment import STORAGE_ROOT
from rayzero.config.errors import RayZeroRuntimeError
from rayzero.config.names import check_name

CONTROL_FILE = "control.json"


@dataclass(frozen=True)
class ControlInfo:
    """What a client needs to reach one run's control service."""

    address: str
    """host:port the service listens on."""
    run_name: str = ""
    tls: bool = False
    """The service speaks TLS ([Note: control-plane TLS] in tls.py)."""
    root_certificates: str | None = None
    """PEM of the CA that signed the service's certificate (public): what a client with no CA of its
    own verifies the service with."""
    ca_fingerprint: str | None = None
    """`sha256:<hex>` of that CA certificate: a client holding its own copy of the CA checks it here."""
    server_name: str | None = None
    """The DNS name in the service's certificate that clients verify (whatever address they dial)."""
    pid: int = 0
    """Process id of the controller actor (for a human reading the file)."""
    written_at: float = field(default_factory=time.time)


def storage_root(storage: str | None) -> str:
    """The runs' root URI, with the same default as `rayzero run` / `rayzero.fit`: `storage`, else
    `$RAYZERO_STORAGE_ROOT`, else ./runs; a plain path becomes a file:// URI."""
    root = storage or STORAGE_ROOT.get() or Path.cwd().joinpath("runs").as_uri()
    if "://" not in root:
        root = Path(root).resolve().as_uri()
    return root.rstrip("/")


def run_uri(name: str, storage: str | None = None) -> str:
    check_name(name, "run name (`rayzero run --name` / RunConfig.name)")  # [Note: names that become paths]
    return f"{storage_root(storage)}/{name}"


def _split(uri: str):
    import pyarrow.fs as pafs  # not at import time: the operator image has no pyarrow

    filesystem, path = pafs.FileSystem.from_uri(uri)
    return filesystem, f"{path.rstrip('/')}/{CONTROL_FILE}"


def write_control_file(run_directory: str, info: ControlInfo) -> str:
    """Write `control.json` atomically under the run directory URI; returns its location."""
    text = json.dumps(asdict(info), indent=2, sort_keys=True) + "\n"
    if run_directory.startswith("file://") or "://" not in run_directory:
        directory = run_directory.removeprefix("file://")
        os.makedirs(directory, exist_ok=True)
        target = os.path.join(directory, CONTROL_FILE)
        temporary = f"{target}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        # Nothing secret inside; O_EXCL | O_NOFOLLOW still, so a planted link cannot redirect the write.
        descriptor = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_WRONLY, 0o644)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
        os.replace(temporary, target)
        return target
    filesystem, path = _split(run_directory)
    with filesystem.open_output_stream(path) as stream:
        stream.write(text.encode())
    return f"{run_directory.rstrip('/')}/{CONTROL_FILE}"


def read_control_file(run_directory: str, name: str = "") -> ControlInfo:
    """The run's ControlInfo; RayZeroRuntimeError naming the location when the run is not live."""
    import pyarrow.fs as pafs

    uri = run_directory if "://" in run_directory else Path(run_directory).resolve().as_uri()
    filesystem, path = _split(uri)
    try:
        with filesystem.open_input_stream(path) as stream:
            raw = json.loads(stream.read().decode())
    except FileNotFoundError:
        exists = filesystem.get_file_info(path.rsplit("/", 1)[0]).type != pafs.FileType.NotFound
        why = ("the run is not running (it ended, or its controller has not started its control "
               "service yet)" if exists else "there is no run directory there")
        raise RayZeroRuntimeError(
            f"no control.json for run {name or uri!r} at {uri}/{CONTROL_FILE}: {why}. Check the name, and "
            "pass --storage (RunConfig.storage) as given to the run, or use --address HOST:PORT "
            "--token-file FILE") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RayZeroRuntimeError(f"{uri}/{CONTROL_FILE} is not valid JSON ({error}); the run "
                                  "writes it, so it is damaged: remove it, the next run writes it again") from None
    known = {key: raw[key] for key in ControlInfo.__dataclass_fields__ if key in raw}
    if not isinstance(known.get("address"), str):
        raise RayZeroRuntimeError(f"{uri}/{CONTROL_FILE} lacks `address`; remove it and restart the run")
    return ControlInfo(**known)


def remove_control_file(run_directory: str) -> None:
    """Remove `control.json` (no error when it is already gone)."""
    filesystem, path = _split(run_directory if "://" in run_directory else Path(run_directory).resolve().as_uri())
    try:
        filesystem.delete_file(path)
    except FileNotFoundError:
        pass


def live_runs(storage: str | None = None) -> list[str]:
    """Names of the runs under the storage root that have a control.json (sorted)."""
    import pyarrow.fs as pafs

    filesystem, root = pafs.FileSystem.from_uri(storage_root(storage))
    try:
        entries = filesystem.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except OSError:
        return []
    names = [entry.base_name for entry in entries if entry.type == pafs.FileType.Directory]
    infos = filesystem.get_file_info([f"{root.rstrip('/')}/{name}/{CONTROL_FILE}" for name in names])
    return sorted(name for name, info in zip(names, infos) if info.type == pafs.FileType.File)
