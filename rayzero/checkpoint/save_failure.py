"""A save that storage refuses (a full disk, a quota, a read-only mount, a foreign directory).

[Note: a save that fails on storage]
A full disk must cost one checkpoint, not the run: the failed save is reported, the previous
committed checkpoint and `latest` stay as they were, training goes on and the next save tries
again. Three things make that so:
  - no rank raises alone. Every step of a save that touches storage (claiming the tag directory,
    writing the shard, receiving replicas, the manifest, `latest`, each durable upload) records a
    failure as a `StorageProblem` instead of raising, and the collective that follows anyway
    carries the problems to every rank (`exchange`). If any rank had one, every rank raises the
    same `CheckpointSaveError` at the same point, so no rank waits at a barrier for a rank that
    left (which would hang the job until the checkpoint group's timeout).
  - nothing half-done stays. The manifest is written only after the exchange that follows the
    shards, and made visible only once every location has written it and `latest` ([Note: a commit
    that space cannot tear] in saver.py); a failure after that un-commits and puts `latest` back. The
    leader then removes the partial tag directory (its lineage's marker proves it is ours), which
    also gives the space back. A durable upload that fails is removed from the durable copy the
    same way; the durable `latest` is written only after every upload and the manifest.
  - the training thread is not interrupted: the saver logs the failure (which checkpoint, which
    rank, which path, why) and keeps it; the next `save_checkpoint` proceeds. Only an explicit
    `wait_for_checkpoint()` (what a planned stop uses before it reports a checkpoint committed)
    raises it, once. Anything that is not a storage failure (a bug, a lost peer) still raises.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from rayzero.checkpoint.retention import ForeignDirectoryError
from rayzero.config.errors import RayZeroRuntimeError


@dataclass(frozen=True)
class StorageProblem:
    """One rank's failure to write one path."""

    rank: int
    path: str
    reason: str
    foreign: bool = False
    """The path is a directory rayzero did not write (the reason says how to fix it), not a disk problem."""

    def __str__(self) -> str:
        return f"rank {self.rank} could not write {self.path}: {self.reason}"


class CheckpointSaveError(RayZeroRuntimeError):
    """A checkpoint (or its durable copy) was not saved because storage refused it; nothing of it
    was committed ([Note: a save that fails on storage])."""

    def __init__(self, tag: str, tier: str, problems: list[StorageProblem]) -> None:
        self.tag, self.tier, self.problems = tag, tier, list(problems)
        what = (f"checkpoint {tag} was not saved" if tier == "local"
                else f"checkpoint {tag} is committed on local disk, but its durable copy was not saved")
        super().__init__(
            f"{what}: {'; '.join(map(str, self.problems))}. The previous committed checkpoint and `latest` "
            "are untouched; training continues and the next save tries again."
            + ("" if all(problem.foreign for problem in self.problems) else
               " Free space on that storage (lower checkpoint.keep_last) or point the checkpoints elsewhere"))

    def __reduce__(self):
        return (type(self), (self.tag, self.tier, self.problems))


@contextlib.contextmanager
def noting(problems: list[StorageProblem], rank: int, path: str) -> Iterator[None]:
    """Run the block; a storage failure in it becomes a StorageProblem in `problems` instead of an
    exception, for the next exchange to share with every rank."""
    try:
        yield
    except OSError as error:  # the file it names, where it names one, else the path the block writes
        where = error.filename if isinstance(error.filename, str) else path
        problems.append(StorageProblem(rank, where, error.strerror or str(error)))
    except ForeignDirectoryError as error:
        problems.append(StorageProblem(rank, path, str(error), foreign=True))
