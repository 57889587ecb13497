"""Where a client finds a run's bearer token, and the controller's local token file.

[Note: the control token never goes to run storage]
A run's storage may be a bucket (s3://, gs://) written with no access control, or a file:// root on a
network filesystem that every node and user mounts. So `control.json` there carries the address, TLS
name and CA fingerprint, never the token. The token lives where only its owner reads it:
- in Kubernetes, the job's Secret (the head pod gets it as RAYZERO_CONTROL_TOKEN; the operator reads
  the Secret);
- otherwise, when the controller generated it, in a file on the controller's own node, mode 0600, in
  a 0700 directory of the user who started the run: `$RAYZERO_CONTROL_TOKEN_DIR`, else
  `~/.rayzero/control`, named `<run name>-<hash of the run URI>.token`. That is the rule for "local":
  the home (or chosen) directory of the controller's user on the controller's node, never the run's
  storage, whatever its scheme. `rayzero status NAME` run there finds it; elsewhere pass
  `--token-file` (a copy) or RAYZERO_CONTROL_TOKEN.
A token is made per attempt: per start of a controller (each `rayzero run` / `rayzero.fit` call; in
Kubernetes each RayJob the operator starts, [Note: the job's tokens]). Worker-group restarts inside
one controller keep it: the service and its clients outlive them and the token never left the node.
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path

from rayzero.config.environment import CONTROL_TOKEN, CONTROL_TOKEN_DIR
from rayzero.config.errors import RayZeroRuntimeError, RayZeroValueError

logger = logging.getLogger(__name__)


def token_directory() -> Path:
    return Path(CONTROL_TOKEN_DIR.get() or Path.home() / ".rayzero" / "control")


def token_path(run_uri: str, run_name: str) -> Path:
    """The controller-node file of the run at `run_uri` (the hash keeps two storages' runs of one
    name apart)."""
    digest = hashlib.sha256(run_uri.rstrip("/").encode()).hexdigest()[:16]
    return token_directory() / f"{run_name}-{digest}.token"


def _private_directory(directory: Path) -> int:
    """An O_DIRECTORY descriptor of `directory` (made 0700 if absent), refused unless it is a real
    directory of ours that nobody else can enter or write."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:  # read-only or foreign home; ELOOP/ENOTDIR: a symlink or a file in its place
        raise RayZeroRuntimeError(
            f"cannot use {directory} for the run's control token ({error.strerror}): set {CONTROL_TOKEN_DIR.name} to a "
            f"private directory this user can write, or give the run a token in {CONTROL_TOKEN.name}") from None
    info = os.fstat(descriptor)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        os.close(descriptor)
        raise RayZeroRuntimeError(
            f"token directory {directory} must belong to uid {os.geteuid()} with mode 0700 (it is uid "
            f"{info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}): `chmod 700 {directory}`, or set "
            f"{CONTROL_TOKEN_DIR.name} to a private directory")
    return descriptor


def write_token_file(path: Path, token: str) -> Path:
    """Create `path` holding `token`, 0600 from the first byte, with O_EXCL | O_NOFOLLOW.

    A file already there is the token of a run of the same name and storage that did not end cleanly
    (its controller died): it is replaced only when it is a regular file of ours; a symlink, another
    user's file or anything else is refused, so nobody can point the token at a file of their choosing.
    """
    directory = _private_directory(path.parent)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        for retry in (False, True):
            try:
                descriptor = os.open(path.name, flags, 0o600, dir_fd=directory)
                break
            except FileExistsError:
                existing = os.stat(path.name, dir_fd=directory, follow_symlinks=False)
                if retry or not stat.S_ISREG(existing.st_mode) or existing.st_uid != os.geteuid():
                    raise RayZeroRuntimeError(
                        f"{path} exists and is not a token file of this user (a symlink, another user's file, "
                        "or a run of the same name starting at the same time); nothing was written: remove "
                        "it if no run of that name is live") from None
                logger.info("replacing the token file of an earlier run that did not end cleanly: %s", path)
                os.unlink(path.name, dir_fd=directory)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(token + "\n")
    except OSError as error:
        raise RayZeroRuntimeError(f"cannot write the run's control token to {path} ({error.strerror}): set "
                                  f"{CONTROL_TOKEN_DIR.name} to a private directory this user can write") from None
    finally:
        os.close(directory)
    return path


def remove_token_file(path: Path, token: str) -> None:
    """Remove `path` if it still holds `token` (a later run of the same name may have replaced it)."""
    try:
        if read_token_file(path) == token:
            path.unlink()
    except (OSError, RayZeroRuntimeError) as error:
        logger.warning("could not remove the token file %s: %s", path, error)


def read_token_file(path: str | Path) -> str:
    """The token in `path` (a regular file, not a symlink); RayZeroValueError naming the file."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RayZeroValueError(f"token file {path} does not exist") from None
    except OSError as error:
        raise RayZeroValueError(f"token file {path} cannot be read ({error.strerror}); give a regular file "
                                "holding the run's token") from None
    with os.fdopen(descriptor) as handle:
        token = handle.read().strip()
    if not token:
        raise RayZeroValueError(f"token file {path} is empty; it must hold the run's token")
    return token


def find_token(run_uri: str, run_name: str, token_file: str | None = None) -> str:
    """The token to send to the run: `token_file`, else $RAYZERO_CONTROL_TOKEN, else the controller's
    local token file when this is its node ([Note: the control token never goes to run storage])."""
    if token_file:
        return read_token_file(token_file)
    if CONTROL_TOKEN.get():
        return CONTROL_TOKEN.get()
    local = token_path(run_uri, run_name)
    if os.path.lexists(local):
        return read_token_file(local)
    raise RayZeroValueError(
        f"no token for run {run_name!r}: the run's control.json does not carry it. On the controller's node "
        f"it is in {local}; elsewhere pass --token-file FILE (a copy of it) or set {CONTROL_TOKEN.name}. In Kubernetes "
        "it is `control_token` in the Secret <job>-rayzero-auth")
