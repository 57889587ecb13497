"""`rayzero run lightning_train.py --workers 2 -- OUT` (issue 20 items 1, 3 and 5): the Lightning script
torchrun runs (tests/data/lightning_train.py: RayZeroStrategy, ModelCheckpoint, no resume code) as
`__main__` on two Ray workers. Rank 1 dies at the start of the third epoch; the group restarts, the
script runs again from the top and its plain `trainer.fit(model)` resumes from the newest
ModelCheckpoint (a logger version back) by itself: every step runs once, the weights are plain SGD's,
and the trainer's step, loss and learning rate are in the run's metrics."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytest.importorskip("lightning")
from tests.data import lightning_train

DATA = Path(__file__).resolve().parents[1] / "data"


def test_rayzero_run_trains_a_lightning_script_that_resumes_by_itself_after_a_worker_dies(local_ray, tmp_path):
    from safetensors.torch import load_file

    from rayzero.checkpoint.cli import main as checkpoint_cli

    out, epochs, per_epoch = tmp_path / "out", 3, lightning_train.BATCHES
    command = [sys.executable, "-m", "rayzero.cli", "run", str(DATA / "lightning_train.py"), "--workers", "2",
               "--name", "lightning", "--storage", tmp_path.as_uri(), "--max-failures", "1", "--",
               str(out), "--epochs", str(epochs), "--crash-at-epoch", "2"]
    env = dict(os.environ, RAY_ADDRESS=local_ray.get_runtime_context().gcs_address)
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "resumes from" in run.stdout + run.stderr  # RayZeroStrategy's line on the restart
    # the logger took a new version on the restart; the resume found the old version's checkpoints
    logs = out / "lightning_logs"
    assert sorted(p.name for p in logs.iterdir()) == ["version_0", "version_1"]
    assert sorted(p.name for p in (logs / "version_1" / "checkpoints").iterdir()) == [
        f"epoch=2-step={epochs * per_epoch}.ckpt"]
    assert checkpoint_cli(["consolidate", str(out / "final.ckpt"), str(tmp_path / "final.safetensors")]) == 0
    weights, expected = load_file(tmp_path / "final.safetensors"), lightning_train.reference_weights(epochs)
    for key, value in expected.items():
        assert float((weights[key] - value).abs().max() / value.abs().max()) <= 1e-5, key
    table = pq.read_table(str(tmp_path / "lightning" / "metrics.parquet")).to_pydict()
    rank0 = [i for i, rank in enumerate(table["rank"]) if rank == 0 and table["step"][i] is not None]
    assert [table["step"][i] for i in rank0] == list(range(1, epochs * per_epoch + 1))  # each step once
    assert [table["lr"][i] for i in rank0] == pytest.approx([0.1] * per_epoch + [0.01] * per_epoch + [0.001] * per_epoch)
    assert all(table["loss"][i] > 0 and table["samples"][i] > 0 for i in rank0)
    # samples count on across the restart (from the checkpoint's callback state), not from 0 again
    per_step = table["samples"][rank0[0]]
    assert [table["samples"][i] for i in rank0] == [step * per_step for step in range(1, epochs * per_epoch + 1)]
