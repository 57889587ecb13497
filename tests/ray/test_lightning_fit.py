"""A Lightning script on rayzero's runtime (issue 20 items 3 and 5): the same file torchrun runs
(tests/data/lightning_train.py: RayZeroStrategy, ModelCheckpoint, no resume or stop code) as a
`rayzero.fit` loop on a real local Ray, stopped through the control service: it saves at the stop,
`rayzero status` shows the trainer's step, and a same-name rerun goes on from the stop."""
from __future__ import annotations

import pytest

import rayzero

pytest.importorskip("lightning")
from tests.data import lightning_train


def test_a_planned_stop_saves_a_lightning_checkpoint_and_a_same_name_rerun_goes_on_from_it(local_ray, tmp_path):
    import threading
    import time

    from rayzero.control_api import connect

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
