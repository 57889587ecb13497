"""Where a restarted Lightning script finds its newest checkpoint, and where a planned stop saves one.

[Note: Lightning restarts]
Inside a rayzero run a restarted group re-runs the user's script from the top (`rayzero run`) or the
user's loop (`rayzero.fit`) with `rayzero.get_context().resuming` true: a restart or resize, a rerun
under the same name and storage, or a resume point given. A Lightning script says only
`trainer.fit(model)`; it should continue where the run got to, as the HF Trainer would with
`resume_from_checkpoint`. So then `RayZeroStrategy.setup` looks, on rank 0, for the committed
RayZeroStrategy checkpoint that is furthest along (highest trainer `global_step`; at one step a
planned stop's own, then the latest commit) in:
  - every `ModelCheckpoint`'s directory, and the directory planned stops save into (`stop_dir`);
  - for Lightning's default directory `<save_dir>/<name>/version_N/checkpoints`, the `checkpoints`
    of every other `version_*` beside it: the logger picks a new version on every restart, so the
    previous attempt's checkpoints are one version back;
  - the run's resume point (`get_context().resume_from`), when it is a RayZeroStrategy checkpoint.
It broadcasts the choice and loads it before Lightning restores loops, callbacks and schedulers from
it (through the checkpoint connector, as `ckpt_path=` would), so no step after it is applied twice.
Checkpoints the engine's step boundary writes on its own carry no trainer state and are not used:
a planned stop also writes a Lightning checkpoint (rayzero/lightning/callback.py). A fresh run and
plain torchrun never resume by themselves.
"""
from __future__ import annotations

import glob
import os
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

STOP_PREFIX = "rayzero-stop-"
"""File name prefix of the checkpoints planned stops write."""


def stop_dir(trainer: Any) -> str:
    """The first ModelCheckpoint's directory, else `<default_root_dir>/checkpoints`."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        return os.fspath(callback.dirpath)
    return os.path.join(trainer.default_root_dir, "checkpoints")


def stop_checkpoint_path(trainer: Any) -> str:
    return os.path.join(stop_dir(trainer), f"{STOP_PREFIX}epoch={trainer.current_epoch}-step={trainer.global_step}.ckpt")


def search_directories(trainer: Any, resume_from: str | None) -> list[str]:
    """Where a restart looks for the newest checkpoint ([Note: Lightning restarts])."""
    directories = [os.fspath(cb.dirpath) for cb in trainer.checkpoint_callbacks
                   if isinstance(cb, ModelCheckpoint) and cb.dirpath]
    directories.append(stop_dir(trainer))
    for directory in list(directories):
        version = os.path.dirname(directory)
        if os.path.basename(directory) == "checkpoints" and os.path.basename(version).startswith("version_"):
            directories += sorted(glob.glob(os.path.join(os.path.dirname(version), "version_*", "checkpoints")))
    if resume_from:
        directories.append(resume_from)
    return list(dict.fromkeys(directories))
