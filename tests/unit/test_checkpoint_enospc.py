"""A full disk during a save ([Note: a save that fails on storage]), on a real small filesystem the
test mounts (loop ext4, else tmpfs; skipped where mounting is not allowed): the failed save is
reported with its checkpoint, rank and path, the previous checkpoint and `latest` stay intact,
training continues, and the next save succeeds once there is room (issue 22 section 1)."""
from __future__ import annotations

import logging
import os

import pytest
import torch

import rayzero
from rayzero.checkpoint.manifest import committed_tags, read_latest, read_manifest
from rayzero.checkpoint.save_failure import CheckpointSaveError
from rayzero.checkpoint.shard_file import file_checksum

pytestmark = pytest.mark.unit


def _engine(**checkpoint):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))  # ~1.1 MiB per checkpoint
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "checkpoint": checkpoint}
    return rayzero.initialize(model=model, config=config)[0]


def _train(engine, steps: int = 1) -> None:
    for _ in range(steps):
        loss = engine(torch.randn(2, 256)).pow(2).mean()
        engine.backward(loss)
        engine.step()


def _weights(engine) -> list[torch.Tensor]:
    return [parameter.detach().clone() for parameter in engine.module.parameters()]


def _intact(root: str, tag: str) -> bool:
    manifest = read_manifest(os.path.join(root, tag))
    return manifest is not None and all(
        file_checksum(os.path.join(root, tag, name)) == entry.checksum for name, entry in manifest.files.items())


def _leftovers(root: str) -> list[str]:
    return [os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names
            if ".tmp" in name or name.endswith(".part")]


@pytest.mark.parametrize("async_save", [True, False])
def test_a_full_disk_costs_one_checkpoint_not_the_run(small_disk, caplog, async_save):
    root = str(small_disk.path / "ckpt")
    engine = _engine(keep_last=2, async_save=async_save)
    try:
        _train(engine)
        engine.save_checkpoint(root)
        engine.wait_for_checkpoint()
        saved = _weights(engine)
        small_disk.fill(leave_bytes=96 << 10)  # room for the marker, not for the shard

        _train(engine)
        with caplog.at_level(logging.ERROR, logger="rayzero.checkpoint.saver"):
            assert engine.save_checkpoint(root)  # not raised into the training loop
            engine.checkpointer.saver.join()
        failure = engine.checkpointer.last_save_failure
        assert isinstance(failure, CheckpointSaveError) and failure.tag == "global_step2" and failure.tier == "local"
        [problem] = failure.problems
        assert problem.rank == 0 and problem.path == os.path.join(root, "global_step2", "rank00000.safetensors")
        assert "No space left on device" in problem.reason
        assert any("checkpoint global_step2 was not saved: rank 0 could not write" in record.getMessage()
                   for record in caplog.records)
        # the previous checkpoint and `latest` are intact; nothing of the failed save is left
        assert read_latest(root) == "global_step1" and [tag for _, tag in committed_tags(root)] == ["global_step1"]
        assert _intact(root, "global_step1")
        assert sorted(os.listdir(root)) == ["global_step1", "latest"] and _leftovers(root) == []

        _train(engine)  # training continues; the next save tries again and fails again, still reported
        engine.save_checkpoint(root)
        engine.checkpointer.saver.join()
        assert engine.checkpointer.last_save_failure.tag == "global_step3"

        small_disk.release()
        _train(engine)
        engine.save_checkpoint(root)  # room again: the save after the failures commits
        engine.wait_for_checkpoint()
        assert engine.checkpointer.last_save_failure is None
        assert read_latest(root) == "global_step4" and _intact(root, "global_step4")
        assert [tag for _, tag in committed_tags(root)] == ["global_step4", "global_step1"]

        # an explicit wait (what a planned stop uses before saying "committed") does hear of it, once
        small_disk.fill(leave_bytes=96 << 10)
        _train(engine)
        engine.save_checkpoint(root)
        with pytest.raises(CheckpointSaveError, match="global_step5 was not saved"):
            engine.wait_for_checkpoint()
        engine.wait_for_checkpoint()
    finally:
        engine.close()
        small_disk.release()

    restored = _engine()  # the step-1 checkpoint loads as saved
    try:
        path, _ = restored.load_checkpoint(root, tag="global_step1")
        assert path.endswith("global_step1") and restored.global_steps == 1
        assert all(torch.equal(got, want) for got, want in zip(_weights(restored), saved))
    finally:
        restored.close()


def test_a_full_durable_disk_keeps_the_durable_copy_and_latest_intact(small_disk, tmp_path):
    durable = small_disk.path / "durable"
    root = str(tmp_path / "local")
    engine = _engine(keep_last=2, async_save=True, durable_uri=durable.as_uri())
    try:
        _train(engine)
        engine.save_checkpoint(root)
        engine.wait_for_checkpoint()
        assert read_latest(str(durable)) == "global_step1"
        small_disk.fill(leave_bytes=96 << 10)

        _train(engine)
        engine.save_checkpoint(root)
        engine.checkpointer.saver.join()
        failure = engine.checkpointer.last_save_failure
        assert failure is not None and failure.tag == "global_step2" and failure.tier == "durable"
        assert "committed on local disk, but its durable copy was not saved" in str(failure)
        assert any(problem.path.startswith(durable.as_uri()) and problem.path.endswith("global_step2/rank00000.safetensors")
                   for problem in failure.problems), failure
        assert read_latest(root) == "global_step2"  # the local tier committed
        assert read_latest(str(durable)) == "global_step1" and _intact(str(durable), "global_step1")
        assert sorted(os.listdir(durable)) == ["global_step1", "latest"] and _leftovers(str(durable)) == []

        small_disk.release()
        _train(engine)
        engine.save_checkpoint(root)
        engine.wait_for_checkpoint()
        assert read_latest(str(durable)) == "global_step3" and _intact(str(durable), "global_step3")
        assert [tag for _, tag in committed_tags(str(durable))] == ["global_step3", "global_step1"]
    finally:
        engine.close()


def test_a_save_whose_latest_cannot_be_written_never_shows_its_manifest(tmp_path):
    """[Note: a commit that space cannot tear]: the chaos soak's disk filled up between the manifest
    and `latest`; the manifest had been visible (a status listed the checkpoint as committed), then
    the save's undo removed it. Here `latest` cannot be written for a real reason (its temporary
    name is taken by a directory); every rename is watched through Python's audit events."""
    import sys

    root = tmp_path / "ckpt"
    renamed: list[str] = []
    watching = [False]

    def audit(event: str, args: tuple) -> None:
        if watching[0] and event in ("os.rename", "os.replace"):
            renamed.append(str(args[1]))

    sys.addaudithook(audit)
    engine = _engine(keep_last=3, async_save=True)
    try:
        _train(engine)
        engine.save_checkpoint(str(root))
        engine.wait_for_checkpoint()
        obstacle = root / f"latest.tmp{os.getpid()}"
        obstacle.mkdir()
        watching[0] = True
        _train(engine)
        engine.save_checkpoint(str(root))
        with pytest.raises(CheckpointSaveError, match="global_step2 was not saved") as raised:
            engine.wait_for_checkpoint()
        watching[0] = False
        [problem] = raised.value.problems
        assert problem.path.startswith(str(root / "latest")), problem
        assert not [path for path in renamed if path.endswith("manifest.json")], renamed  # never visible
        assert read_latest(str(root)) == "global_step1" and [tag for _, tag in committed_tags(str(root))] == ["global_step1"]
        obstacle.rmdir()
        assert sorted(os.listdir(root)) == ["global_step1", "latest"] and _leftovers(str(root)) == []
        _train(engine)
        engine.save_checkpoint(str(root))  # the obstacle gone: the next save commits
        engine.wait_for_checkpoint()
        assert read_latest(str(root)) == "global_step3" and _intact(str(root), "global_step3")
    finally:
        watching[0] = False
        engine.close()


def test_a_durable_manifest_once_moved_into_place_is_never_taken_back(tmp_path, caplog):
    """The durable copy's side of the same note: `latest` is blocked (a non-empty directory holds its
    name, so the move fails after the manifest's). The copy stays committed, `latest` names the
    previous checkpoint, and that is said; before, the manifest was deleted again."""
    durable, root = tmp_path / "durable", str(tmp_path / "local")
    engine = _engine(keep_last=3, async_save=True, durable_uri=durable.as_uri())
    try:
        _train(engine)
        engine.save_checkpoint(root)
        engine.wait_for_checkpoint()
        (durable / "latest").unlink()
        (durable / "latest").mkdir()
        (durable / "latest" / "someone's file").write_text("x")
        _train(engine)
        with caplog.at_level(logging.WARNING, logger="rayzero.checkpoint.durable"):
            engine.save_checkpoint(root)
            engine.wait_for_checkpoint()  # no failure: the durable copy committed
        assert [tag for _, tag in committed_tags(str(durable))] == ["global_step2", "global_step1"]
        assert _intact(str(durable), "global_step2") and not (durable / "latest.tmp").exists()
        assert any("durable copy of global_step2 is committed, but" in record.getMessage() for record in caplog.records)
    finally:
        engine.close()
