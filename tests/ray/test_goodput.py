"""Goodput, live (issue 24 item 1): a run with known, injected delays (saves that sleep, a worker that
dies after its checkpoint) reports its goodput and each cause within 10 % of what was injected, in
the Result, `rayzero status` (the gRPC Status), metrics.parquet, goodput.json, the summary line and
the plot; a same-name rerun goes on counting."""
from __future__ import annotations

import threading
import time

import pytest
import ray

import rayzero
from rayzero import plot
from rayzero.driver.fit import controller_actor_name
from rayzero.driver.metrics_store import read_goodput, read_metrics

pytestmark = pytest.mark.ray

STEP_S, SAVE_SLEEP_S, SAVE_AT, CRASH_AT, STEPS = 0.5, 3.0, 10, 15, 20


def delayed_loop(config):
    import torch

    from rayzero.engine import checkpoint_io

    saving = checkpoint_io.save_checkpoint

    def slow_save(*args, **kwargs):  # the injected stall: every save sleeps first
        time.sleep(SAVE_SLEEP_S)
        return saving(*args, **kwargs)

    checkpoint_io.save_checkpoint = slow_save
    context = rayzero.get_context()
    torch.manual_seed(0)
    engine = rayzero.initialize(model=torch.nn.Linear(4, 1), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "checkpoint": {"async_save": False}})[0]
    for step in engine.steps(config["steps"]):
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
        time.sleep(STEP_S)
        rayzero.report({"step": step + 1})
        if step + 1 == SAVE_AT or step + 1 == config["steps"]:
            started = time.monotonic()
            engine.save_checkpoint()
            with open(f"{config['saves']}/{context.attempt}-{context.rank}-{step + 1}", "w") as out:
                out.write(str(time.monotonic() - started))  # the stall as the loop saw it
        if context.attempt == 0 and context.rank == 1 and step + 1 == CRASH_AT:
            raise RuntimeError("the injected failure")


def test_goodput_and_its_causes_match_the_injected_delays(local_ray, tmp_path, capsys):
    seen: dict = {}

    def watch() -> None:  # the gRPC-facing status while the run is in its second attempt
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and "status" not in seen:
            try:
                status = ray.get(ray.get_actor(controller_actor_name("gp")).status.remote())
                if status.attempt == 1 and status.goodput is not None:
                    seen["status"] = status
            except Exception:  # noqa: BLE001 - not started yet, or already gone
                pass
            time.sleep(0.5)

    saves = tmp_path / "saves"
    saves.mkdir()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result = rayzero.fit(delayed_loop, scaling=rayzero.ScalingConfig(num_workers=2),
                         run=rayzero.RunConfig(storage=tmp_path.as_uri(), name="gp"),
                         failure=rayzero.FailureConfig(backoff_s=0),
                         train_loop_config={"steps": STEPS, "saves": str(saves)})
    watcher.join(30)
    good = result.goodput
    badput = good["badput_s"]
    # saves at steps 10 and 20 each slept 3 s: the checkpoint stall, with what the real save added (the
    # slowest rank's, as the loops timed it: a loaded machine makes it more than a little)
    stalled: dict = {}
    for name in saves.iterdir():
        attempt, _, step = name.name.split("-")
        stalled[attempt, step] = max(stalled.get((attempt, step), 0.0), float(name.read_text()))
    assert set(stalled) == {("0", str(SAVE_AT)), ("1", str(STEPS))}, stalled
    assert 2 * SAVE_SLEEP_S <= badput["checkpoint stall"] == pytest.approx(sum(stalled.values()), rel=0.1), \
        (badput, stalled)
    # what the reports show (rank 0's, timed by the worker): under load a step takes more than STEP_S
    rows = read_metrics(result.path, rank=0, raw=True).to_pylist()
    at = {(row["attempt"], row["step"]): row["time"] for row in rows}
    assert at[0, CRASH_AT] - at[0, SAVE_AT] >= (CRASH_AT - SAVE_AT) * STEP_S  # the loop slept that much
    # the crash at step 15 after the checkpoint at step 10: steps 11-15 ran again (the save of step 10,
    # after its report, is a stall)
    redone = at[0, CRASH_AT] - at[0, SAVE_AT] - stalled["0", str(SAVE_AT)]
    assert badput["redone steps"] == pytest.approx(redone, rel=0.1), (badput, redone)
    # kept: steps 2-10 of the first attempt and 12-20 of the second (the first step of an attempt is
    # its start-up)
    kept = at[0, SAVE_AT] - at[0, 1] + at[1, STEPS] - at[1, SAVE_AT + 1]
    assert kept >= 18 * STEP_S
    assert good["productive_s"] == pytest.approx(kept, rel=0.1), (good, kept)
    # from the crash to the second attempt's first step: detection + restart, as the reports show
    last_of_first = max(row["time"] for row in rows if row["attempt"] == 0)
    first_of_second = min(row["time"] for row in rows if row["attempt"] == 1)
    gap = first_of_second - last_of_first
    assert badput["failure detection"] + badput["restart"] + badput["idle"] == pytest.approx(gap, rel=0.1, abs=0.5)
    assert sum(badput.values()) + good["productive_s"] == pytest.approx(good["wall_s"], rel=1e-3)
    assert good["goodput"] == pytest.approx(good["productive_s"] / good["wall_s"], rel=1e-3)
    # everywhere it is shown
    status = seen.get("status")
    assert status is not None and 0 < status.goodput < 1 and set(status.badput_s) == set(badput)
    assert read_goodput(result.path)["wall_s"] == pytest.approx(good["wall_s"], rel=0.05)
    goodput_rows = read_metrics(result.path, goodput=True).to_pylist()
    assert {(row["attempt"], row["goodput_cause"]) for row in goodput_rows} >= {(0, "productive"), (1, "restart")}
    assert all(row["goodput_seconds"] >= 0 for row in goodput_rows)
    assert "goodput_cause" not in read_metrics(result.path).column_names  # the reports are reports
    assert f"goodput {100 * good['goodput']:.1f}%" in capsys.readouterr().out
    picture = plot.plot_run(result.path, str(tmp_path / "gp.png"))
    assert picture.goodput["goodput"] == pytest.approx(good["goodput"])
    # a same-name rerun goes on counting: its wall time adds to the first call's
    again = rayzero.fit(delayed_loop, scaling=rayzero.ScalingConfig(num_workers=2),
                        run=rayzero.RunConfig(storage=tmp_path.as_uri(), name="gp"),
                        failure=rayzero.FailureConfig(backoff_s=0),
                        train_loop_config={"steps": STEPS, "saves": str(saves)})
    assert again.goodput["wall_s"] > good["wall_s"]
    assert again.goodput["productive_s"] == pytest.approx(good["productive_s"], rel=0.05)  # nothing left to train
