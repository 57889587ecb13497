"""Where a run lives: its name, its directory under the storage root, its checkpoint directory, and
the checkpoint it resumes from (`fit`'s "locate the run" step)."""
from __future__ import annotations

import datetime
import secrets
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from rayzero.checkpoint.storage import filesystem_from_uri
from rayzero.config.environment import RESUME_FROM, STORAGE_ROOT
from rayzero.config.errors import RayZeroValueError
from rayzero.config.names import check_name
from rayzero.config.run_settings import RunConfig
from rayzero.controller import committed_checkpoints
from rayzero.driver.say import say
from rayzero.workers.boundary import NODE_LOCAL_RESUME


@dataclass(frozen=True)
class RunLocation:
    """A run's place in storage, settled before Ray starts."""

    name: str
    uri: str
    """The run's directory: `<storage root>/<name>`, a URI."""
    checkpoint_dir: str
    """`<run>/checkpoints`: a local path for file:// storage, else a URI."""
    rerun: bool
    """The run's directory existed already: a rerun under the same name."""
    resume_from: str | None
    """What the first attempt resumes from (a checkpoint directory, NODE_LOCAL_RESUME or None)."""


def locate_run(run: RunConfig, node_local: bool) -> RunLocation:
    """Step 2 of `fit` (fit.py): name the run, create and probe its directory, and find what it resumes
    from: the resume point asked for, else (a rerun under the same name) its newest committed checkpoint."""
    name, run_uri, checkpoint_dir, rerun = _run_locations(run)
    requested = run.resume_from or RESUME_FROM.get()
    resume_from = resolve_resume_from(requested, explicit=bool(run.resume_from))
    if resume_from is None and requested is None:
        resume_from = _resume_same_name(name, run_uri, checkpoint_dir, node_local)
    return RunLocation(name, run_uri, checkpoint_dir, rerun, resume_from)


def _run_locations(run: RunConfig) -> tuple[str, str, str, bool]:
    """(run name, run URI, checkpoint dir: a local path for file://, else a URI, whether the run's
    directory existed already: a rerun under the same name)."""
    name = check_name(run.name or f"rayzero-{datetime.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}",
                      "RunConfig.name")  # [Note: names that become paths]; a RunConfig may be built unvalidated
    root = run.storage or STORAGE_ROOT.get() or Path.cwd().joinpath("runs").as_uri()
    if "://" not in root:  # a plain path is a local directory
        root = Path(root).resolve().as_uri()
    run_uri = f"{root.rstrip('/')}/{name}"
    filesystem, path = filesystem_from_uri(run_uri)
    try:
        existed = filesystem.get_file_info(path).type != pafs.FileType.NotFound
    except OSError:
        existed = False  # _check_writable names the trouble
    _check_writable(root, run_uri)
    checkpoint_dir = f"{path}/checkpoints" if run_uri.startswith("file://") else f"{run_uri}/checkpoints"
    return name, run_uri, checkpoint_dir, existed


def _check_writable(root: str, run_uri: str) -> None:
    """Create the run's directory and write a probe file there, before any worker starts: an
    unwritable `--storage` is named with its reason at once, not as a traceback from a worker."""
    probe = f"{filesystem_from_uri(run_uri)[1]}/.rayzero-write-probe-{secrets.token_hex(4)}"
    try:
        filesystem, path = filesystem_from_uri(run_uri)
        filesystem.create_dir(path, recursive=True)
        with filesystem.open_output_stream(probe) as stream:
            stream.write(b"rayzero checks that the run directory is writable\n")
        filesystem.delete_file(probe)
    except (OSError, ValueError, pa.ArrowException) as error:
        raise RayZeroValueError(
            f"storage {root!r} (RunConfig.storage / --storage): cannot write the run directory {run_uri}: "
            f"{error}. Give a location this machine and every node can write: a directory (./runs, "
            "file:///shared/runs) or an object store URI (s3://bucket/prefix) with its credentials set"
        ) from None


def resolve_resume_from(location: str | None, explicit: bool) -> str | None:
    """The checkpoint directory to hand the loop for a resume point given as any of:
    a checkpoint directory (holds `latest`), a run directory (`<storage>/<name>`, what the Kubernetes
    operator passes on a retried attempt: its `checkpoints/` is used) or a single checkpoint (holds
    `manifest.json`). A location with no committed checkpoint yet (an attempt that failed before its
    first save) means a fresh start, said on the driver. file:// becomes a local path, like
    $RAYZERO_CHECKPOINT_DIR; other URIs stay URIs.
    """
    if not location:
        return None
    uri = location if "://" in location else Path(location).resolve().as_uri()
    filesystem, path = filesystem_from_uri(uri)

    def exists(relative: str) -> bool:
        target = f"{path.rstrip('/')}/{relative}" if relative else path
        return filesystem.get_file_info(target).type != pafs.FileType.NotFound

    def as_location(relative: str) -> str:
        base = path if uri.startswith("file://") else uri
        return f"{base.rstrip('/')}/{relative}" if relative else base

    for relative, marker in (("", "latest"), ("", "manifest.json"), ("checkpoints", "latest")):
        if exists(f"{relative}/{marker}" if relative else marker):
            return as_location(relative)
    if not exists("") and explicit:
        raise RayZeroValueError(
            f"RunConfig.resume_from / --resume-from = {location!r} does not exist; give a checkpoint "
            "directory (with `latest`), a run directory (<storage>/<name>) or one checkpoint"
        )
    say(f"[rayzero] resume point {location} holds no committed checkpoint yet: starting from scratch")
    return None


def _resume_same_name(name: str, run_uri: str, checkpoint_dir: str, node_local: bool) -> str | None:
    """A rerun with the same name and storage goes on from the run's newest committed checkpoint
    (Ray Train v2's contract), found through the checkpoint layer's manifests."""
    if node_local:  # the checkpoints are on the nodes' disks: each rank looks at its own
        filesystem, path = filesystem_from_uri(run_uri)
        if filesystem.get_file_info(f"{path}/metrics.parquet").type == pafs.FileType.NotFound:
            return None
        say(f"[rayzero] run {name} exists: resuming from the newest checkpoint on the nodes' disks")
        return NODE_LOCAL_RESUME
    found = committed_checkpoints.newest([checkpoint_dir])
    if found is None:
        return None
    say(f"[rayzero] run {name} exists: resuming from its checkpoint {found.record.location} "
          f"(step {found.record.step})")
    return found.root
