"""A Lightning script on rayzero's runtime (issue 20 items 3 and 5): the same file torchrun runs
(tests/data/lightning_train.py: RayZeroStrategy, ModelCheckpoint, no resume code) as a `rayzero.fit`
loop on a real local Ray. A worker dies mid-run; the controller restarts the group and the script's
plain `trainer.fit(model)` resumes from its newest ModelCheckpoint by itself: every step runs once,
the weights are plain SGD's, and the trainer's step, loss and learning rate reach the run's metrics."""
from __future__ import annotations

import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

import rayzero

pytest.importorskip("lightning")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
import lightning_train


def test_a_lightning_script_resumes_by_itself_after_a_worker_dies(local_ray, tmp_path):
    from safetensors.torch import load_file

    from rayzero.checkpoint.cli import main as checkpoint_cli

    out = tmp_path / "out"
    epochs, per_epoch = 3, lightning_train.BATCHES
    result = rayzero.fit(lightning_train.train, scaling=rayzero.ScalingConfig(num_workers=2),
                         run=rayzero.RunConfig(name="lightning", storage=tmp_path.as_uri(), progress_interval_s=0),
                         failure=rayzero.FailureConfig(max_failures=1),
                         train_loop_config={"out": str(out), "epochs": epochs, "crash_at_epoch": 2})
    assert result.failures == 1
    reports = [m for m in result.metrics_history if "step" in m]
    # rank 1 died at the start of the third epoch; the restart went on from the second epoch's checkpoint
    assert [m["step"] for m in reports] == list(range(1, epochs * per_epoch + 1))  # each step once
    assert [m["lr"] for m in reports] == pytest.approx([0.1] * 4 + [0.01] * 4 + [0.001] * 4)
    # the logger took a new version on the restart; the resume found the old version's checkpoints
    assert sorted(p.name for p in (out / "lightning_logs").iterdir()) == ["version_0", "version_1"]
    assert sorted(p.name for p in (out / "lightning_logs" / "version_1" / "checkpoints").iterdir()) == [
        f"epoch=2-step={epochs * per_epoch}.ckpt"]
    assert checkpoint_cli(["consolidate", str(out / "final.ckpt"), str(tmp_path / "final.safetensors")]) == 0
    weights, expected = load_file(tmp_path / "final.safetensors"), lightning_train.reference_weights(epochs)
    for key, value in expected.items():
        assert float((weights[key] - value).abs().max() / value.abs().max()) <= 1e-5, key
    table = pq.read_table(str(tmp_path / "lightning" / "metrics.parquet")).to_pydict()
    rank0 = [i for i, rank in enumerate(table["rank"]) if rank == 0 and table["step"][i] is not None]
    assert {"loss", "lr", "samples"} <= set(table) and all(table["loss"][i] > 0 for i in rank0)
    assert torch.tensor([table["step"][i] for i in rank0]).tolist() == list(range(1, epochs * per_epoch + 1))
