"""A rank's heartbeat names the newest committed checkpoint wherever its loop saved it: the run's
checkpoint directory, or a directory the script chose (an HF Trainer's `output_dir/checkpoint-N`,
told to the step boundary by `engine.save_checkpoint(save_dir)`). Real manifests on disk, committed
by the checkpoint layer's own commit."""
from __future__ import annotations

import os
import shutil

from rayzero.checkpoint.manifest import Manifest, commit, set_latest
from rayzero.workers.boundary import StepBoundary


def _commit(root, step: int) -> str:
    tag = f"global_step{step}"
    tag_dir = root / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    commit(str(tag_dir), Manifest(tag=tag, step=step, world_size=1, stage=0, config_digest="", files={},
                                  tensors={}, rank_states=[]))
    set_latest(str(root), tag)
    return str(tag_dir)


def test_the_newest_commit_over_the_run_directory_and_the_loop_s_own_save_directories(tmp_path):
    run, out = tmp_path / "run" / "checkpoints", tmp_path / "out"
    boundary = StepBoundary(rank=0, node_id="node", checkpoint_dir=str(run))
    assert boundary.newest_committed() is None  # nothing saved, the run directory not even made
    in_run = _commit(run, 4)
    assert boundary.newest_committed() == (4, in_run)

    boundary.saving_into(str(out / "checkpoint-8"))  # the Trainer's save_steps directory
    assert boundary.newest_committed() == (4, in_run)  # told before the save: nothing committed there yet
    trainer_8 = _commit(out / "checkpoint-8", 8)
    assert boundary.newest_committed() == (8, trainer_8)

    boundary.saving_into(str(out / "checkpoint-12"))
    (out / "checkpoint-12" / "global_step12").mkdir(parents=True)  # a save under way: no manifest yet
    assert boundary.newest_committed() == (8, trainer_8)
    trainer_12 = _commit(out / "checkpoint-12", 12)
    assert boundary.newest_committed() == (12, trainer_12)

    shutil.rmtree(out / "checkpoint-12")  # rotated away (save_total_limit) or lost: the next newest
    assert boundary.newest_committed() == (8, trainer_8)

    # only the last three directories are listed, so a heartbeat costs the same at any step
    for step in (16, 20, 24):
        boundary.saving_into(str(out / f"checkpoint-{step}"))
        _commit(out / f"checkpoint-{step}", step)
    shutil.rmtree(out / "checkpoint-24")
    shutil.rmtree(out / "checkpoint-20")
    shutil.rmtree(out / "checkpoint-16")
    assert boundary.newest_committed() == (4, in_run)  # checkpoint-8 is no longer listed
    assert os.path.isdir(trainer_8)
