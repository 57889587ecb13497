"""What a new user hit in the first hour (issue 21), reproduced as a user meets it: the README's own
loop, a stopped worker seen through `status`, an unwritable storage path."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

import rayzero
from rayzero.driver.fit import controller_actor_name
from rayzero.driver.metrics_store import read_metrics

pytestmark = pytest.mark.ray

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_loop() -> str:
    """The README's first Python example, as written."""
    text = README.read_text()
    section = text[text.index("**From Python**"):]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_readme_loop_runs_as_written_and_a_rerun_goes_on_from_its_checkpoint(local_ray, tmp_path):
    code = _readme_loop()
    assert "engine.steps(" in code and "range(config" not in code  # the resuming shape
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "RAYZERO_ADDRESS")}
    (tmp_path / "first.py").write_text(code)
    first = subprocess.run([sys.executable, "first.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600, check=False)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "starting a local Ray" in first.stdout, first.stdout  # as a new user runs it: a Ray of its own
    # the same program with more steps: a rerun of `exp1` goes on from step 200, not from 0. What is
    # proved is where it resumes from (the run's storage, ./runs), not which Ray runs it: it joins the
    # tests' shared Ray instead of paying for a second start-up of its own.
    (tmp_path / "more.py").write_text(code.replace('{"steps": 200}', '{"steps": 203}'))
    more = subprocess.run([sys.executable, "more.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(env, RAY_ADDRESS=local_ray.get_runtime_context().gcs_address), check=False)
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert "resuming from its checkpoint" in more.stdout and "(step 200)" in more.stdout, more.stdout
    rows = read_metrics(str(tmp_path / "runs" / "exp1"), rank=0)
    steps, attempts = rows.column("step").to_pylist(), rows.column("attempt").to_pylist()
    assert steps == list(range(1, 204))  # each step once
    assert {attempt for step, attempt in zip(steps, attempts) if step > 200} == {1}  # the rerun's own


def stopping_loop(config):
    import torch

    context = rayzero.get_context()
    torch.manual_seed(0)
    engine, _, _, _ = rayzero.initialize(model=torch.nn.Linear(4, 1), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.01}}})
    Path(config["dir"], f"pid-{context.rank}-{context.attempt}").write_text(str(os.getpid()))
    # the first attempt runs long enough to be stopped and found hung; the one after the restart
    # (resumed from step 5) has nothing left to show, so it ends a few steps later
    for step in engine.steps(config["steps"] if context.attempt == 0 else 8):
        loss = engine(torch.ones(2, 4)).sum()
        engine.backward(loss)
        engine.step()
        rayzero.report({"step": step + 1, "loss": loss.item(), "samples": 4 * (step + 1)})
        if step + 1 == 5:
            engine.save_checkpoint()  # the loop's own checkpoint: status must see it
        time.sleep(0.05)


def test_a_stopped_worker_shows_in_status_and_the_hang_report_leads_with_its_stacks(local_ray, tmp_path, capsys):
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = rayzero.fit(
                stopping_loop, scaling=rayzero.ScalingConfig(num_workers=2),
                run=rayzero.RunConfig(storage=tmp_path.as_uri(), name="sigstop"),
                failure=rayzero.FailureConfig(max_failures=1, hang_timeout_s=8, backoff_s=0),
                train_loop_config={"dir": str(tmp_path), "steps": 400})
        except BaseException as error:  # noqa: BLE001 - reported by the assertions below
            outcome["error"] = error

    driver = threading.Thread(target=run)
    driver.start()
    pid_file = tmp_path / "pid-1-0"
    deadline = time.monotonic() + 180
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    controller = ray.get_actor(controller_actor_name("sigstop"))
    while time.monotonic() < deadline:  # status sees the loop's own checkpoint and measures throughput
        status = ray.get(controller.status.remote())
        if status.checkpoints and status.samples_per_s:
            break
        time.sleep(0.3)
    assert [record.step for record in status.checkpoints] == [5], status
    assert status.samples_per_s > 0 and status.step >= 5
    pid = int(pid_file.read_text())
    os.kill(pid, signal.SIGSTOP)
    try:
        seen = None
        while time.monotonic() < deadline:
            status = ray.get(controller.status.remote())
            ages = {rank.rank: rank.heartbeat_age_s for rank in status.ranks}
            if ages.get(1, 0.0) > 4.0:
                seen = ages
                break
            time.sleep(0.3)
        assert seen is not None, "rank 1's heartbeat age never grew"
        assert seen[0] < 3.0, seen  # the healthy rank still answers; the stopped one's age grows
        driver.join(300)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert "result" in outcome, outcome.get("error")
    assert outcome["result"].failures == 1  # the hang ended the first attempt; the second finished
    out = capsys.readouterr().out
    report = out[out.index("hang detected: rank 1"):]
    assert "stopped answering its heartbeats" in report.splitlines()[0]
    first_stacks = report[report.index("--- rank"):]
    assert first_stacks.startswith("--- rank 1 Python stacks (culprit) ---"), first_stacks[:300]
    assert "read from outside with py-spy" in first_stacks.split("--- rank 0")[0]
    assert "stopping_loop" in first_stacks.split("--- rank 0")[0]  # its own frames, read while stopped


def test_an_unwritable_storage_is_named_before_any_worker_starts(tmp_path):
    (tmp_path / "train.py").write_text("def loop(config):\n    pass\n")
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1}')
    done = subprocess.run([sys.executable, "-m", "rayzero.cli", "run", "train.py:loop", "--config", "ds.json",
                           "--storage", "file:///proc/x"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--storage" in done.stderr and "/proc/x" in done.stderr and "cannot write" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert "starting a local Ray" not in done.stdout  # checked before Ray and the workers


def _engine(config=None):
    import torch

    torch.manual_seed(0)
    return rayzero.initialize(model=torch.nn.Linear(4, 1), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "checkpoint": {"async_save": False}})[0]


def flaky_loop(config):
    import torch

    context = rayzero.get_context()
    engine = _engine()
    for step in engine.steps(8):
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
        rayzero.report({"step": step + 1})
        if (step + 1) % 2 == 0:
            engine.save_checkpoint()  # synchronous: committed before the failure below
        if context.attempt < 3 and step + 1 == 2 * (context.attempt + 1):  # each attempt after a new checkpoint
            raise RuntimeError(f"a flaky worker (attempt {context.attempt})")


def broken_loop(config):
    import torch

    engine = _engine()
    for step in engine.steps(16):
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
        if step == 2:
            raise RuntimeError("a bug that fails the same step every time")


def test_by_default_a_run_keeps_going_through_failures_while_it_checkpoints(local_ray, tmp_path, capsys):
    # one worker: the policy under test counts failures and checkpoints, not ranks (every restart
    # starts the whole group again, ~4 CPU-s per worker)
    result = rayzero.fit(flaky_loop, scaling=rayzero.ScalingConfig(num_workers=1),
                         run=rayzero.RunConfig(storage=tmp_path.as_uri(), name="flaky"),
                         failure=rayzero.FailureConfig(backoff_s=0))  # the defaults, minus the wait
    assert result.failures == 3 and result.checkpoint_step == 8
    assert [m["step"] for m in result.metrics_history] == list(range(1, 9))
    # each restart's line names the checkpoint it resumed from, although the new attempt commits the
    # next one two steps later (the line named that newer one when both reached the driver together)
    said = re.findall(r"\(restarted: resumed from the checkpoint of step (\d+)\)", capsys.readouterr().out)
    assert said == ["2", "4", "6"]


def test_by_default_a_failure_that_keeps_coming_back_ends_the_run_saying_how_to_go_on(local_ray, tmp_path, capsys):
    with pytest.raises(rayzero.TrainingFailedError) as raised:
        rayzero.fit(broken_loop, scaling=rayzero.ScalingConfig(num_workers=1),  # one, as above
                    run=rayzero.RunConfig(storage=tmp_path.as_uri(), name="broken"),
                    failure=rayzero.FailureConfig(backoff_s=0))
    message = str(raised.value)
    assert "a bug that fails the same step every time" in message
    assert "3 failures in a row came without a newer checkpoint" in message
    assert "max_failures_without_progress" in message and "Run it again with the same name" in message
    assert capsys.readouterr().out.count("restarting the worker group") == 2  # three tries in all


@pytest.mark.parametrize(("flags", "expected"), [
    (["--workers", "0"], ("--workers 0: give a count >= 1 or a range with 1 <= min <= max: (2, 8) in Python, "
                          "--workers 2:8 on the command line")),
    (["--name", "../escape"], "run name '../escape' contains a path separator; use one plain directory name"),
    (["--hang-timeout", "-1"], "--hang-timeout -1.0: must be greater than or equal to 0"),
])
def test_the_cli_names_the_flag_its_value_and_the_fix(tmp_path, flags, expected):
    (tmp_path / "train.py").write_text("def loop(config):\n    pass\n")
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1}')
    done = subprocess.run([sys.executable, "-m", "rayzero.cli", "run", "train.py:loop", "--config", "ds.json", *flags],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and expected in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
