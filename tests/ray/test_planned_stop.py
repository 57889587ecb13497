"""Planned stops lose nothing: the driver's SIGTERM, `stop`, `checkpoint now` and resizes all save at one
step every rank reaches — in a loop that never saves — and the run goes on from there (real local Ray)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from testkit import elastic_loop, subprocess_env

import rayzero
from rayzero.driver.fit import controller_actor_name
from rayzero.driver.metrics_store import read_metrics


def _finals(result) -> tuple[list[float], int]:
    final = [m for m in result.metrics_history if "final" in m][-1]
    return final["final"], final["final_step"]


def _steps(result) -> list[dict]:
    return [m for m in result.metrics_history if "step" in m]


# A driver of its own, so the test can signal it: argv = run name, storage, the loop's config as JSON.
DRIVER = textwrap.dedent("""
    import json, sys
    import rayzero
    from testkit import elastic_loop
    rayzero.fit(elastic_loop.train, config=elastic_loop.config(), scaling=rayzero.ScalingConfig(num_workers=2),
                run=rayzero.RunConfig(name=sys.argv[1], storage=sys.argv[2], progress_interval_s=0),
                train_loop_config=json.loads(sys.argv[3]))
    print("FIT RETURNED", flush=True)
""")


def _start_driver(local_ray, storage: Path, name: str, loop_config: dict) -> subprocess.Popen:
    script = storage / "driver.py"
    script.write_text(DRIVER)
    env = subprocess_env(RAY_ADDRESS=local_ray.get_runtime_context().gcs_address)
    return subprocess.Popen([sys.executable, str(script), name, storage.as_uri(), json.dumps(loop_config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _read_until(driver: subprocess.Popen, text: str) -> list[str]:
    """The driver's lines up to the first that contains `text` (all of them if it ends first)."""
    lines = []
    for line in driver.stdout:
        lines.append(line)
        if text in line:
            break
    return lines


def test_driver_sigterm_is_a_planned_stop_a_killed_driver_loses_only_uncommitted_steps_and_reruns_resume(
        local_ray, tmp_path):
    """One run ended twice by its driver, each time run again with the same name and storage:
    - SIGTERM to the driver is a planned stop: `fit` returns, and the loop, which never saves, leaves
      exactly one committed checkpoint, the boundary save;
    - the rerun resumes from exactly that step; its driver is then killed (SIGKILL: no stop, no save)
      while the loop saves every 2 steps;
    - the next rerun loses only the steps after the newest committed checkpoint: it resumes from that
      one, keeps it, appends to the metrics log and ends with plain SGD's weights (which it could not
      if either resume had gone wrong)."""
    run = tmp_path / "stopped"
    driver = _start_driver(local_ray, tmp_path, "stopped", {"steps": 10_000, "sleep": 0.05})
    lines = _read_until(driver, "step 3 ")  # training is under way
    driver.send_signal(signal.SIGTERM)
    out, _ = driver.communicate(timeout=120)
    output = "".join(lines) + out
    assert driver.returncode == 0, output
    assert "FIT RETURNED" in output and "stopped: checkpoint" in output, output
    boundary = sorted(p.name for p in (run / "checkpoints").iterdir() if (p / "manifest.json").exists())
    assert len(boundary) == 1, boundary  # the loop never saves: this is the boundary save
    stopped_at = int(boundary[0].removeprefix("global_step"))
    assert stopped_at >= 3

    driver = _start_driver(local_ray, tmp_path, "stopped", {"steps": 10_000, "sleep": 0.05, "save_every": 2})
    lines = _read_until(driver, f"step {stopped_at + 5} | loss")
    driver.kill()  # SIGKILL: no stop, no checkpoint; the controller and workers go with the driver
    driver.communicate(timeout=60)
    output = "".join(lines)
    resuming = next((line for line in lines if "resuming from its checkpoint" in line), "")
    assert boundary[0] in resuming and resuming.endswith(f"(step {stopped_at})\n"), output
    # with progress_interval_s=0 every report of rank 0 prints; those of steps carry the loss
    reported = [int(line.split()[2]) for line in lines if line.startswith("[rayzero] step ") and "| loss " in line]
    assert reported == list(range(stopped_at + 1, stopped_at + 6)), output  # going on from the boundary save

    def newest() -> int:
        return max(int(p.name.removeprefix("global_step")) for p in (run / "checkpoints").glob("global_step*")
                   if (p / "manifest.json").exists())

    # Ray ends the dead driver's actors shortly after; until then its workers may still commit.
    committed, stable_since = newest(), time.monotonic()
    while time.monotonic() - stable_since < 3:
        time.sleep(0.2)
        if newest() != committed:
            committed, stable_since = newest(), time.monotonic()
    rows_before = read_metrics(str(run)).num_rows
    result = rayzero.fit(elastic_loop.train, config=elastic_loop.config(), scaling=rayzero.ScalingConfig(num_workers=2),
                         run=rayzero.RunConfig(name="stopped", storage=tmp_path.as_uri(), progress_interval_s=30),
                         train_loop_config={"steps": committed + 2})
    steps = _steps(result)
    assert steps[0]["started_at"] == committed and [m["step"] for m in steps] == [committed + 1, committed + 2]
    weights, final_step = _finals(result)
    assert final_step == committed + 2
    assert weights == pytest.approx(elastic_loop.reference_weights(final_step), abs=1e-5)
    assert read_metrics(str(run)).num_rows > rows_before
    # the rerun kept the checkpoint it resumed from (retention keeps the newest three)
    assert (run / "checkpoints" / f"global_step{committed}" / "manifest.json").exists()


def _fit_in_thread(**kwargs):
    box: dict = {}

    def target():
        try:
            box["result"] = rayzero.fit(elastic_loop.train, **kwargs)
        except BaseException as error:  # noqa: BLE001 - re-raised by the test
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def _controller(ray, name: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(controller_actor_name(name))
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _wait_for(condition, timeout_s: float = 60.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_checkpoint_now_resize_and_stop_through_the_control_target(local_ray, tmp_path):
    ray = local_ray
    thread, box = _fit_in_thread(
        config=elastic_loop.config(), scaling=rayzero.ScalingConfig(num_workers=(1, 2)),
        run=rayzero.RunConfig(name="control", storage=tmp_path.as_uri(), progress_interval_s=0),
        train_loop_config={"steps": 10_000, "sleep": 0.05})
    controller = _controller(ray, "control")
    _wait_for(lambda: ray.get(controller.status.remote()).step >= 2, what="step 2")
    status = ray.get(controller.status.remote())
    assert status.state == "running" and status.world_size == 2 and (status.min_workers, status.max_workers) == (1, 2)
    assert [r.rank for r in status.ranks] == [0, 1] and all(r.memory_bytes > 0 for r in status.ranks)

    record = ray.get(controller.checkpoint_now.remote(60.0))
    assert record.step >= 2 and Path(record.location, "manifest.json").exists()

    with pytest.raises(ValueError, match="elastic range is 1:2"):
        ray.get(controller.scale.remote(3))
    ray.get(controller.scale.remote(1))  # planned shrink: boundary checkpoint, regroup with 1
    _wait_for(lambda: ray.get(controller.status.remote()).world_size == 1
              and ray.get(controller.status.remote()).state == "running", what="the resize to 1")
    _wait_for(lambda: ray.get(controller.status.remote()).step >= record.step + 4, what="training at 1 worker")

    final = ray.get(controller.stop.remote(120.0))
    thread.join(120)
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert result.stopped and result.failures == 0 and result.checkpoint_step == final.step
    steps = _steps(result)
    worlds = [m["world"] for m in steps]
    assert worlds[0] == 2 and worlds[-1] == 1 and sorted(worlds, reverse=True) == worlds
    assert {m["gas"] for m in steps if m["world"] == 1} == {6} and {m["gas"] for m in steps if m["world"] == 2} == {3}
    # no step lost or repeated across the resize: the regrouped loop starts where the boundary save was
    assert [m["step"] for m in steps] == list(range(1, len(steps) + 1))
    weights, final_step = _finals(result)
    assert final_step == final.step, [(m.get("step"), m.get("world"), m.get("final_step")) for m in result.metrics_history]
    # global batch kept at 12 through 2 -> 1 workers: the same weights as one uninterrupted process
    assert weights == pytest.approx(elastic_loop.reference_weights(final_step), abs=1e-5)
    manifest = json.loads(Path(final.location, "manifest.json").read_text())
    assert manifest["step"] == final.step and manifest["world_size"] == 1


def test_an_elasticity_block_decides_the_batch_for_the_size_that_fits(local_ray, tmp_path):
    config = dict(elastic_loop.config(), elasticity={
        "enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [2, 3], "min_gpus": 1, "max_gpus": 4,
        "ignore_non_elastic_batch_info": True, "version": 0.1})
    result = rayzero.fit(elastic_loop.train, config=config, scaling=rayzero.ScalingConfig(num_workers=(1, 2)),
                         run=rayzero.RunConfig(storage=tmp_path.as_uri(), progress_interval_s=30),
                         train_loop_config={"steps": 3})
    steps = _steps(result)
    # DeepSpeed's algorithm over micro batches 2 and 3 under 12 gives a global batch of 12; at 2 workers
    # the largest listed micro batch dividing 12 / 2 = 6 is 3, so gas is 2
    assert {(m["world"], m["gas"]) for m in steps} == {(2, 2)}
    weights, _ = _finals(result)
    assert weights == pytest.approx(elastic_loop.reference_weights(3), abs=1e-5)
