"""Where a resume point given as a checkpoint dir, a run dir or one checkpoint leads (no Ray needed)."""
from __future__ import annotations

import pytest

from rayzero.driver.run_location import resolve_resume_from


def _run_dir(tmp_path, committed: bool):
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "global_step5").mkdir(parents=True)
    (checkpoints / "global_step5" / "rank00000.safetensors").write_bytes(b"")
    if committed:
        (checkpoints / "global_step5" / "manifest.json").write_text("{}")
        (checkpoints / "latest").write_text("global_step5")
    return tmp_path / "run"


def test_a_run_directory_leads_to_its_checkpoints(tmp_path):
    run = _run_dir(tmp_path, committed=True)
    expected = str(run / "checkpoints")
    assert resolve_resume_from(run.as_uri(), explicit=False) == expected  # the operator's form
    assert resolve_resume_from(str(run / "checkpoints"), explicit=True) == expected
    one = run / "checkpoints" / "global_step5"
    assert resolve_resume_from(one.as_uri(), explicit=True) == str(one)


def test_no_committed_checkpoint_means_a_fresh_start(tmp_path, capsys):
    run = _run_dir(tmp_path, committed=False)  # an attempt that died mid-save
    assert resolve_resume_from(run.as_uri(), explicit=False) is None
    assert "no committed checkpoint" in capsys.readouterr().out
    assert resolve_resume_from(str(tmp_path / "never-made"), explicit=False) is None


def test_an_explicit_resume_point_that_does_not_exist_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_resume_from(str(tmp_path / "typo"), explicit=True)
