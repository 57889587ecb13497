"""Retention owns only its own ([Note: retention owns only its own]): keep_last counts every committed
checkpoint but deletes only the ones the saver's own run session wrote, in the save directory and in the
durable copy alike."""
from __future__ import annotations

import json
import os

import pytest

from rayzero.checkpoint.durable import DurableStore
from rayzero.checkpoint.manifest import Manifest, apply_retention, commit, committed_tags

pytestmark = pytest.mark.unit


def _commit(root: str, step: int, session: str) -> None:
    tag_dir = os.path.join(root, f"global_step{step}")
    os.makedirs(tag_dir)
    commit(tag_dir, Manifest(f"global_step{step}", step, 1, 1, "", {}, {}, [], run_session=session))


def _steps(root: str) -> list[int]:
    return sorted(step for step, _ in committed_tags(root))


def test_keep_last_never_deletes_another_sessions_checkpoints(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3):
        _commit(root, step, "first-run")
    for step in (4, 5, 6, 7):
        _commit(root, step, "rerun")
    deleted = apply_retention(root, keep_last=2, owned=lambda manifest: manifest.run_session == "rerun")
    assert sorted(deleted) == ["global_step4", "global_step5"]
    assert _steps(root) == [1, 2, 3, 6, 7]
    # without an owner rule (a direct caller) every old checkpoint goes, as before
    apply_retention(root, keep_last=2)
    assert _steps(root) == [6, 7]


def test_the_durable_copy_follows_the_same_rule(tmp_path):
    for step, session in ((1, "first-run"), (2, "rerun"), (3, "rerun"), (4, "rerun")):
        _commit(str(tmp_path), step, session)
    store = DurableStore(tmp_path.as_uri())
    store.apply_retention(1, owned=lambda manifest: manifest.run_session == "rerun")
    assert [manifest.step for manifest in store.committed()] == [4, 1]


def test_a_manifest_written_before_sessions_existed_still_reads():
    body = json.loads(Manifest("global_step1", 1, 1, 1, "", {}, {}, []).to_json())
    del body["run_session"]
    assert Manifest.from_json(json.dumps(body)).run_session == ""
