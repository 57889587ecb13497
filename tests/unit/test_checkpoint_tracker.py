"""The controller's checkpoint tracker finds a script's save made after the last heartbeat
([Note: saves after the last heartbeat] in rayzero/controller/committed_checkpoints.py).

Found as a user: an HF Trainer run (`--save_steps 500`) whose worker was SIGKILLed right after
checkpoint-1000 committed resumed from checkpoint-1000 (the Trainer takes its newest complete
checkpoint-N), but the controller, whose last heartbeat had named checkpoint-500, said "resuming from
…/checkpoint-500" and counted steps 500-1000 as redone."""
from __future__ import annotations

import os

import pytest

from rayzero.checkpoint.manifest import Manifest, commit
from rayzero.controller.committed_checkpoints import CheckpointTracker, numbered_siblings

pytestmark = pytest.mark.unit


def _save(save_dir, step: int, committed: bool = True, tag_name: str = "") -> str:
    """A rayzero checkpoint of `step` in `save_dir` as the Trainer's engine writes it (global_stepN), or
    under `tag_name` (RayZeroStrategy's `checkpoint`)."""
    tag = save_dir / (tag_name or f"global_step{step}")
    os.makedirs(tag)
    if committed:
        commit(str(tag), Manifest(tag=tag.name, step=step, world_size=1, stage=2, config_digest="d",
                                       files={}, tensors={}, rank_states=[]))
    else:
        (tag / "rank00000.safetensors").write_bytes(b"half a save")
    return str(tag)


def test_a_restart_resumes_from_a_trainer_checkpoint_committed_after_the_last_heartbeat(tmp_path):
    out = tmp_path / "out"
    run_dir = tmp_path / "run"
    heard = _save(out / "checkpoint-500", 500)
    tracker = CheckpointTracker((str(run_dir),), node_local=False)
    tracker.note_heartbeat((500, heard))
    # after the heartbeat: checkpoint-1000 commits; checkpoint-1500 is half written when the rank dies;
    # a directory of another name and a number-less one are not the Trainer's
    _save(out / "checkpoint-1000", 1000)
    _save(out / "checkpoint-1500", 1500, committed=False)
    _save(out / "other-2000", 2000)
    (out / "checkpoint-last").mkdir()
    assert tracker.resume_location() == str(out / "checkpoint-1000")
    assert tracker.latest.step == 1000 and tracker.latest.location == str(out / "checkpoint-1000" / "global_step1000")
    # the next heartbeat of the restarted run names its own saves as before
    later = _save(out / "checkpoint-2000", 2000)
    tracker.note_heartbeat((2000, later))
    assert tracker.resume_location() == str(out / "checkpoint-2000") and tracker.latest.step == 2000


def test_nothing_newer_beside_the_heard_checkpoint_changes_nothing(tmp_path):
    out = tmp_path / "out"
    heard = _save(out / "checkpoint-1000", 1000)
    _save(out / "checkpoint-500", 500)  # older, left by save_total_limit or an earlier save
    tracker = CheckpointTracker((str(tmp_path / "run"),), node_local=False)
    tracker.note_heartbeat((1000, heard))
    assert tracker.resume_location() == str(out / "checkpoint-1000") and tracker.latest.step == 1000


def test_a_restart_resumes_from_a_lightning_checkpoint_committed_after_the_last_heartbeat(tmp_path):
    """Found as a user: a Lightning module under `rayzero run`, ModelCheckpoint(every_n_train_steps=100),
    a worker SIGKILLed right after epoch=3-step=200.ckpt committed. RayZeroStrategy resumed from it; the
    controller said "resuming from …/epoch=1-step=100.ckpt" and the restart line "resumed from the
    checkpoint of step 100"."""
    ckpts = tmp_path / "ckpts"
    heard = _save(ckpts / "epoch=1-step=100.ckpt", 100, tag_name="checkpoint")
    tracker = CheckpointTracker((str(tmp_path / "run"),), node_local=False)
    tracker.note_heartbeat((100, heard))
    _save(ckpts / "epoch=3-step=200.ckpt", 200, tag_name="checkpoint")
    _save(ckpts / "epoch=3-step=250.ckpt", 250, committed=False, tag_name="checkpoint")  # half written
    _save(ckpts / "last-step=300.ckpt", 300, tag_name="checkpoint")  # another name: not this callback's
    assert tracker.resume_location() == str(ckpts / "epoch=3-step=200.ckpt")
    assert tracker.latest.step == 200


def test_numbered_siblings_are_the_same_name_with_a_larger_number_largest_first(tmp_path):
    for name in ("checkpoint_3", "checkpoint_12", "checkpoint_4", "checkpoint_2", "checkpoints_9", "checkpoint_x"):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint_30").write_text("a file, not a save directory")
    assert numbered_siblings(str(tmp_path / "checkpoint_3")) == [str(tmp_path / "checkpoint_12"),
                                                                str(tmp_path / "checkpoint_4")]
    assert numbered_siblings(str(tmp_path / "checkpoint_x")) == []
    for name in ("epoch=1-step=100.ckpt", "epoch=1-step=150.ckpt", "epoch=3-step=200.ckpt", "epoch=0-step=50.ckpt"):
        (tmp_path / name).mkdir()
    assert numbered_siblings(str(tmp_path / "epoch=1-step=100.ckpt")) == [str(tmp_path / "epoch=3-step=200.ckpt"),
                                                                         str(tmp_path / "epoch=1-step=150.ckpt")]
    assert numbered_siblings(str(tmp_path / "gone" / "checkpoint_1")) == []
