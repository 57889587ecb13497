"""Issue 21 item 9: a worker says a checkpoint is coming only when it is: SIGTERM alone (which Ray's
own teardown sends too: `rayzero kill`, another rank failed) announces nothing; the agreed boundary
says it is saving when it is."""
from __future__ import annotations

import logging

import pytest
import torch
from testkit import harness as H

pytestmark = pytest.mark.dist


def _run(rank: int, world_size: int, checkpoint_dir: str) -> dict:
    import rayzero
    from rayzero.engine.engine import set_step_boundary_hook
    from rayzero.workers.actor import TrainWorker
    from rayzero.workers.boundary import StepBoundary
    from rayzero.workers.session import WorkerSession

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("rayzero.workers").addHandler(Keep(logging.DEBUG))
    logging.getLogger("rayzero.workers").setLevel(logging.DEBUG)
    boundary = StepBoundary(rank, "node", None, checkpoint_dir)
    worker = TrainWorker()  # not a Ray actor here: its SIGTERM handler, called as the signal would
    worker._session, worker._running = WorkerSession(rank=rank, boundary=boundary), True
    worker._on_sigterm(15, None)
    said_at_the_signal = [line for line in records if "checkpoint" in line]
    torch.manual_seed(0)
    engine = rayzero.initialize(model=torch.nn.Linear(4, 1), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "checkpoint": {"async_save": False}}, )[0]
    set_step_boundary_hook(boundary)
    try:
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()  # the agreed boundary: the preemption's checkpoint is written here
    finally:
        set_step_boundary_hook(None)
    return {"at_signal": said_at_the_signal, "all": records, "stopped": boundary.should_stop()}


def test_sigterm_announces_a_checkpoint_only_when_it_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYZERO_CHECKPOINT_DIR", str(tmp_path))
    for outcome in H.spawn(2, _run, str(tmp_path), timeout_s=180):
        assert outcome["at_signal"] == [], outcome  # nothing promised at the signal
        assert any("got SIGTERM: saving the checkpoint of step 1, then stopping" in line
                   for line in outcome["all"]), outcome
        assert outcome["stopped"]
    assert (tmp_path / "global_step1" / "manifest.json").exists()
