"""[Note: retention owns only its own]: keep_last deletes only tag directories whose owner marker names
the saver's run lineage, never by file name; a run's lineage spans its same-name invocations; the
durable copy follows the same rule (issue 22 section 1, issue 21 item 10)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from rayzero.checkpoint.checkpointer import Checkpointer
from rayzero.checkpoint.durable import DurableStore
from rayzero.checkpoint.manifest import Manifest, commit, committed_tags, read_latest
from rayzero.checkpoint.options import CheckpointOptions
from rayzero.checkpoint.retention import (
    OWNER_FILE,
    ForeignDirectoryError,
    apply_retention,
    claim_run_lineage,
    claim_tag_dir,
    owner_text,
)
from rayzero.checkpoint.types import ShardedTensor, ShardSpec
from rayzero.config.environment import RUN_LINEAGE

pytestmark = pytest.mark.unit

SPEC = ShardSpec("module/w", (4,), torch.float32, 0, 4)


def _save(checkpointer: Checkpointer, root: str, step: int) -> None:
    checkpointer.save(root, f"global_step{step}", step, 0, [ShardedTensor(SPEC, torch.full((4,), float(step)))])
    checkpointer.wait()  # retention runs after the commit, off the caller's path


def _steps(root: str) -> list[int]:
    return sorted(step for step, _ in committed_tags(root))


def _foreign(root: str) -> dict[str, bytes]:
    """What a user keeps next to the checkpoints: names that look like shards and temporaries."""
    files = {"exported/model.safetensors": b"user weights", "scratch/notes.tmp": b"half a thought",
             "global_step999x/rank00000.safetensors": b"looks like ours, is not"}
    for relative, data in files.items():
        os.makedirs(os.path.join(root, os.path.dirname(relative)), exist_ok=True)
        with open(os.path.join(root, relative), "wb") as out:
            out.write(data)
    return files


def test_foreign_directories_survive_many_saves(tmp_path):
    root = str(tmp_path / "ckpt")
    foreign = _foreign(root)
    checkpointer = Checkpointer(CheckpointOptions(async_save=False, keep_last=2))
    for step in range(1, 8):
        _save(checkpointer, root, step)
    assert _steps(root) == [6, 7]
    for relative, data in foreign.items():
        with open(os.path.join(root, relative), "rb") as source:
            assert source.read() == data, relative


def test_an_interrupted_save_of_the_lineage_is_cleaned_up_and_nobody_elses(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_LINEAGE.name, "run-a")
    root = str(tmp_path / "ckpt")
    ours = os.path.join(root, "global_step5")  # a save of run-a that died before its commit
    claim_tag_dir(ours, "run-a")
    open(os.path.join(ours, "rank00000.safetensors.tmp"), "wb").close()
    theirs = os.path.join(root, "global_step6")  # another run's save in flight (or dead)
    claim_tag_dir(theirs, "run-b")
    open(os.path.join(theirs, "rank00000.safetensors.tmp"), "wb").close()
    _save(Checkpointer(CheckpointOptions(async_save=False, keep_last=2)), root, 10)
    assert not os.path.exists(ours)
    assert sorted(os.listdir(theirs)) == sorted([OWNER_FILE, "rank00000.safetensors.tmp"])


def test_keep_last_is_the_newest_n_of_the_run_across_its_invocations(tmp_path, monkeypatch):
    """Issue 21 item 10: five invocations of one run name with keep_last 3 used to leave 12
    checkpoints; another run writing into the same directory keeps all of its own."""
    runs = tmp_path / "runs"
    root = str(tmp_path / "shared-ckpt")
    lineage = claim_run_lineage((runs / "exp1").as_uri())
    assert claim_run_lineage((runs / "exp1").as_uri()) == lineage  # every invocation of exp1
    other = claim_run_lineage((runs / "exp2").as_uri())
    assert other != lineage
    step = 0
    for invocation in range(5):
        monkeypatch.setenv(RUN_LINEAGE.name, lineage)
        checkpointer = Checkpointer(CheckpointOptions(async_save=False, keep_last=3))
        for _ in range(3):
            step += 1
            _save(checkpointer, root, step)
        if invocation == 1:  # another run saves into the same directory meanwhile
            monkeypatch.setenv(RUN_LINEAGE.name, other)
            stranger = Checkpointer(CheckpointOptions(async_save=False, keep_last=1))
            for theirs in (100, 101):
                _save(stranger, root, theirs)
    assert _steps(root) == [13, 14, 15, 101]  # exp2's keep_last 1 rotated its own 100
    assert read_latest(root) == "global_step15"


def test_a_save_into_a_foreign_directory_is_refused_and_reported(tmp_path, caplog):
    root = str(tmp_path / "ckpt")
    os.makedirs(os.path.join(root, "global_step3"))
    with open(os.path.join(root, "global_step3", "model.safetensors"), "wb") as out:
        out.write(b"user weights")
    with pytest.raises(ForeignDirectoryError):
        claim_tag_dir(os.path.join(root, "global_step3"), "run-a")
    checkpointer = Checkpointer(CheckpointOptions(async_save=False))
    _save(checkpointer, root, 2)
    checkpointer.save(root, "global_step3", 3, 0, [ShardedTensor(SPEC, torch.ones(4))])  # not raised: reported
    failure = checkpointer.last_save_failure
    assert failure is not None and "global_step3" in str(failure) and "was not written by rayzero" in str(failure)
    assert "Free space" not in str(failure)  # its fix is its own (move it away), not a full disk's
    assert sorted(os.listdir(os.path.join(root, "global_step3"))) == ["model.safetensors"]
    assert read_latest(root) == "global_step2" and _steps(root) == [2]
    _save(checkpointer, root, 4)  # training goes on; the next save works
    assert _steps(root) == [2, 4]


def test_a_directory_left_by_a_save_killed_before_its_marker_is_saved_into_again(tmp_path):
    # a save SIGKILLed between making the directory and publishing its marker leaves only the
    # marker's temporary (seen in a full run: the restarted run's save of that step was refused)
    root = str(tmp_path / "ckpt")
    torn = os.path.join(root, "global_step6")
    os.makedirs(torn)
    with open(os.path.join(torn, "rayzero-owner.json.tmp19435"), "w") as out:
        out.write(owner_text("run-a"))
    checkpointer = Checkpointer(CheckpointOptions(async_save=False))
    _save(checkpointer, root, 6)
    assert checkpointer.last_save_failure is None, checkpointer.last_save_failure
    assert _steps(root) == [6] and "rayzero-owner.json.tmp19435" not in os.listdir(torn)
    # what still is not rayzero's stays refused: a temporary-looking name that holds no marker, or
    # a marker's temporary beside a file rayzero did not write
    for names in ({"rayzero-owner.json.tmp1": "not a marker"},
                  {"rayzero-owner.json.tmp1": owner_text("run-a"), "notes.txt": "mine"}):
        other = tmp_path / f"other{len(names)}"
        other.mkdir()
        for name, text in names.items():
            (other / name).write_text(text)
        with pytest.raises(ForeignDirectoryError):
            claim_tag_dir(str(other), "run-a")
        assert sorted(os.listdir(other)) == sorted(names)
    # the durable copy: an upload killed between staging its marker and moving it into place
    durable = tmp_path / "durable"
    (durable / "global_step6").mkdir(parents=True)
    (durable / "global_step6" / "rayzero-owner.json.tmp").write_text(owner_text("run-a"))
    (durable / "global_step7").mkdir()
    (durable / "global_step7" / "rayzero-owner.json.tmp").write_text("not a marker")
    store = DurableStore(durable.as_uri())
    store.claim("global_step6", "run-a")
    assert store.owner("global_step6") == "run-a" and os.listdir(durable / "global_step6") == ["rayzero-owner.json"]
    with pytest.raises(ForeignDirectoryError):
        store.claim("global_step7", "run-a")


def _durable_commit(root: str, tag: str, step: int, owner: str | None, manifest_tag: str | None = None) -> None:
    tag_dir = os.path.join(root, tag)
    if owner is None:
        os.makedirs(tag_dir)
    else:
        claim_tag_dir(tag_dir, owner)
    commit(tag_dir, Manifest(manifest_tag or tag, step, 1, 1, "", {}, {}, []))


def test_the_durable_copy_follows_the_same_rule(tmp_path):
    root = str(tmp_path)
    for step, owner in ((1, "first-run"), (2, "rerun"), (3, None), (4, "rerun"), (5, "rerun")):
        _durable_commit(root, f"global_step{step}", step, owner)
    claim_tag_dir(os.path.join(root, "global_step6"), "rerun")  # an upload of ours that died
    os.makedirs(os.path.join(root, "exported"))
    open(os.path.join(root, "exported", "model.safetensors"), "wb").close()
    store = DurableStore(tmp_path.as_uri())
    store.apply_retention(2, "rerun")
    assert [manifest.step for _, manifest in store.committed()] == [5, 4, 3, 1]
    assert sorted(os.listdir(root)) == ["exported", "global_step1", "global_step3", "global_step4", "global_step5"]


def test_a_tampered_durable_manifest_cannot_aim_a_delete_outside(tmp_path):
    """A durable manifest saying its tag is `../victim` used to make retention delete `<root>/../victim`."""
    root = tmp_path / "durable"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    _durable_commit(str(root), "global_step1", 1, "run-a")
    body = json.loads((root / "global_step1" / "manifest.json").read_text())
    body["tag"] = "../victim"
    (root / "global_step1" / "manifest.json").write_text(json.dumps(body))
    for step in (2, 3):
        _durable_commit(str(root), f"global_step{step}", step, "run-a")
    store = DurableStore(root.as_uri())
    store.apply_retention(1, "run-a")
    assert (victim / "keep.txt").read_text() == "precious"
    assert [tag for tag, _ in store.committed()] == ["global_step3"]


def test_a_file_a_user_dropped_into_an_old_checkpoint_survives_its_deletion(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_LINEAGE.name, "run-a")
    root = str(tmp_path / "ckpt")
    checkpointer = Checkpointer(CheckpointOptions(async_save=False, keep_last=1))
    _save(checkpointer, root, 1)
    with open(os.path.join(root, "global_step1", "notes.md"), "w") as out:
        out.write("why step 1 matters")
    _save(checkpointer, root, 2)
    assert _steps(root) == [2]
    assert os.listdir(os.path.join(root, "global_step1")) == ["notes.md"]
    assert apply_retention(root, 1, "run-a") == []  # nothing of ours is left there to remove


def test_a_manifest_written_before_lineages_still_reads():
    body = json.loads(Manifest("global_step1", 1, 1, 1, "", {}, {}, []).to_json())
    del body["lineage"]
    body["run_session"] = "exp1-0a1b2c"
    assert Manifest.from_json(json.dumps(body)).lineage == "exp1-0a1b2c"
