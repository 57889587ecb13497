"""The monitors, progress lines and timers users read under DeepSpeed, from the engine on 2 gloo ranks:
TensorBoard and CSV files with DeepSpeed's tags written by rank 0 only ([Note: monitor events])."""
from __future__ import annotations

import csv
import logging
import os
from pathlib import Path

import pytest
from testkit.harness import LR, build_model, global_batch, spawn

pytestmark = pytest.mark.dist

STEPS, GAS, MICRO = 4, 2, 2


def _train(rank: int, world: int, out: str) -> dict:
    import rayzero

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    engine_logger = logging.getLogger("rayzero.engine")
    engine_logger.addHandler(handler)
    engine_logger.setLevel(logging.INFO)
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": LR}},
        "fp16": {"enabled": True, "initial_scale_power": 8},
        "steps_per_print": 2, "wall_clock_breakdown": True,
        "tensorboard": {"enabled": True, "output_path": os.path.join(out, f"tb{rank}"), "job_name": "job"},
        "csv_monitor": {"enabled": True, "output_path": os.path.join(out, f"csv{rank}"), "job_name": "job"},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 200},
    }
    engine, _, _, _ = rayzero.initialize(model=build_model(), config=config)
    losses, lrs = [], []
    for step in range(STEPS):
        tokens, targets = global_batch(step, world * GAS * MICRO)
        window = []
        for micro in range(GAS):
            start = (micro * world + rank) * MICRO
            loss = engine(tokens[start:start + MICRO], targets[start:start + MICRO])
            engine.backward(loss)
            engine.step()
            window.append(loss.item())
        losses.append(sum(window) / GAS)
        lrs.append(engine.get_lr()[0])
    engine.close()
    engine_logger.removeHandler(handler)
    return {"losses": losses, "lrs": lrs, "records": records, "scale": float(engine.loss_scaler.loss_scale)}


def _read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as handle:
        return list(csv.reader(handle))


def test_rank0_writes_deepspeeds_tags_to_csv_and_tensorboard(tmp_path):
    world = 2
    results = spawn(world, _train, str(tmp_path))
    samples = [world * GAS * MICRO * (step + 1) for step in range(STEPS)]
    csv_dir = tmp_path / "csv0" / "job"
    names = {path.name for path in csv_dir.iterdir()}
    assert {"Train_Samples_train_loss.csv", "Train_Samples_lr.csv", "Train_Samples_loss_scale.csv",
            "Train_Samples_elapsed_time_ms_forward.csv", "Train_Samples_elapsed_time_ms_backward.csv",
            "Train_Samples_elapsed_time_ms_backward_inner.csv",
            "Train_Samples_elapsed_time_ms_backward_allreduce.csv",
            "Train_Samples_elapsed_time_ms_step.csv"} == names
    loss_rows = _read_csv(csv_dir / "Train_Samples_train_loss.csv")
    assert loss_rows[0] == ["step", "train_loss"]  # DeepSpeed's header: the tag's last part
    assert [int(row[0]) for row in loss_rows[1:]] == samples  # step axis: samples trained
    assert [float(row[1]) for row in loss_rows[1:]] == pytest.approx(results[0]["losses"], rel=1e-6)
    assert [float(row[1]) for row in _read_csv(csv_dir / "Train_Samples_lr.csv")[1:]] == pytest.approx(
        results[0]["lrs"], rel=1e-9)
    assert float(_read_csv(csv_dir / "Train_Samples_loss_scale.csv")[-1][1]) == results[0]["scale"]
    forward_ms = [float(row[1]) for row in _read_csv(csv_dir / "Train_Samples_elapsed_time_ms_forward.csv")[1:]]
    assert len(forward_ms) == STEPS and all(value > 0 for value in forward_ms)
    assert not (tmp_path / "csv1").exists() and not (tmp_path / "tb1").exists(), "rank 1 writes nothing"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb0" / "job"))
    events.Reload()
    assert {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale"} <= set(
        events.Tags()["scalars"])
    assert [event.step for event in events.Scalars("Train/Samples/train_loss")] == samples

    progress = [line for line in results[0]["records"] if line.startswith("step=")]
    assert [line.split(",")[0] for line in progress] == ["step=2", "step=4"]  # steps_per_print: 2
    assert all("skipped=" in line and "lr=" in line and "mom=" in line for line in progress)
    assert any(line.startswith("rank 0 step 1 time (ms) | forward:") for line in results[0]["records"])
    assert not any(line.startswith("step=") for line in results[1]["records"])
