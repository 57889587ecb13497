"""Which `checkpoint-N` an HF Trainer resumes from after a restart ([Note: the Trainer in a rayzero
run]): the newest one the Trainer finished (its trainer_state.json, written last) whose engine
checkpoint, when it holds one, is committed for that step. Real manifests (the checkpoint layer's
own commit), directories laid out as the Trainer and the engine write them."""
from __future__ import annotations

import pytest

from rayzero.checkpoint.manifest import Manifest, commit
from rayzero.compat.trainer import newest_complete_checkpoint

pytestmark = pytest.mark.unit


def _checkpoint(root, step: int, trainer_state: bool = True, engine: str | None = "committed") -> None:
    directory = root / f"checkpoint-{step}"
    directory.mkdir()
    if trainer_state:
        (directory / "trainer_state.json").write_text("{}")
    if engine is not None:
        tag = directory / f"global_step{step}"
        tag.mkdir()
        (tag / "rank00000.safetensors").write_bytes(b"")
        if engine == "committed":
            commit(str(tag), Manifest(f"global_step{step}", step, 1, 2, "", {}, {}, []))


def test_the_newest_finished_checkpoint_with_a_committed_engine_checkpoint_wins(tmp_path):
    _checkpoint(tmp_path, 4)
    _checkpoint(tmp_path, 8)
    _checkpoint(tmp_path, 12, engine="uncommitted")  # killed while the shards were written
    _checkpoint(tmp_path, 16, trainer_state=False)  # killed before the Trainer wrote its state
    (tmp_path / "checkpoint-20-tmp").mkdir()  # not a Trainer checkpoint name
    (tmp_path / "runs").mkdir()
    assert newest_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-8")


def test_steps_compare_as_numbers_and_a_plain_ddp_checkpoint_needs_only_its_trainer_state(tmp_path):
    _checkpoint(tmp_path, 9, engine=None)
    _checkpoint(tmp_path, 10, engine=None)
    assert newest_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")
    assert newest_complete_checkpoint(str(tmp_path / "missing")) is None
    assert newest_complete_checkpoint("") is None
