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


def test_a_planned_stop_saves_a_lightning_checkpoint_and_a_same_name_rerun_goes_on_from_it(local_ray, tmp_path):
    import threading
    import time

    from rayzero.control import connect

    out, storage = tmp_path / "out", tmp_path.as_uri()
    run = rayzero.RunConfig(name="stopped", storage=storage, progress_interval_s=0)
    outcome: dict = {}

    def first_run() -> None:
        outcome["result"] = rayzero.fit(lightning_train.train, scaling=rayzero.ScalingConfig(num_workers=2), run=run,
                                        train_loop_config={"out": str(out), "epochs": 50, "batch_sleep": 0.2})

    thread = threading.Thread(target=first_run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and "result" not in outcome:
        try:
            with connect("stopped", storage=storage) as control:
                if control.status().step >= 3:  # the trainer's step, as RayZeroStrategy's callback reports it
                    saved = control.stop()
                    break
        except Exception as error:  # noqa: BLE001 - not serving yet
            outcome["last_error"] = error
        time.sleep(0.5)
    thread.join(300)
    result = outcome["result"]
    assert result.stopped and saved is not None
    stopped_at = max(m["step"] for m in result.metrics_history if "step" in m)
    checkpoints = out / "lightning_logs" / "version_0" / "checkpoints"
    stop_file = f"rayzero-stop-epoch={(stopped_at - 1) // lightning_train.BATCHES}-step={stopped_at}.ckpt"
    assert stop_file in {p.name for p in checkpoints.iterdir()}, sorted(checkpoints.iterdir())

    epochs = (stopped_at // lightning_train.BATCHES) + 2
    rerun = rayzero.fit(lightning_train.train, scaling=rayzero.ScalingConfig(num_workers=2), run=run,
                        train_loop_config={"out": str(out), "epochs": epochs})
    steps = [m["step"] for m in rerun.metrics_history if "step" in m]
    assert steps == list(range(stopped_at + 1, epochs * lightning_train.BATCHES + 1))  # from the stop, once each
