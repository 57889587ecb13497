"""The control plane end to end (issue 11's "done when"): `rayzero.fit` runs in one process; from
others, `rayzero status --json`, `rayzero checkpoint now` (a committed checkpoint at or after the
step seen, though the loop never saves), `rayzero stop` (the run exits 0 with a final checkpoint);
rerunning the same name resumes; a call without the token is UNAUTHENTICATED. Prints the latencies
(status round trip, watch interval, checkpoint-now to commit, stop to exit) against the step time."""
from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import grpc
import pytest
from testkit import control_driver


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rayzero.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_status_checkpoint_now_stop_and_resume_from_other_processes(local_ray, tmp_path, monkeypatch, capsys):
    storage = (tmp_path / "runs").as_uri()
    # The controller's local token file goes here, where the CLI processes (same "node") find it.
    monkeypatch.setenv("RAYZERO_CONTROL_TOKEN_DIR", str(tmp_path / "tokens"))
    env = dict(os.environ, RAY_ADDRESS=local_ray.get_runtime_context().gcs_address,
               RAYZERO_CONTROL_HOST="127.0.0.1")
    env.pop("RAYZERO_CONTROL_TOKEN", None)
    driver = subprocess.Popen([sys.executable, str(control_driver.PATH), "e2e", storage, "100000"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    control_file = tmp_path / "runs" / "e2e" / "control.json"
    try:
        import rayzero.control_api

        deadline = time.monotonic() + 120
        while not control_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        with rayzero.control_api.connect("e2e", storage=storage) as client:  # cheap polling, in-process
            while client.status().step < 3 and time.monotonic() < deadline:
                time.sleep(0.2)
        answer = _cli("status", "e2e", "--storage", storage, "--json", env=env)
        assert answer.returncode == 0, answer.stderr
        status = json.loads(answer.stdout)
        assert status["step"] >= 3, status
        assert status["state"] == "running" and status["world_size"] == 2 and status["loss"] is not None
        for key in ("attempt", "min_workers", "max_workers", "samples_per_s", "checkpoints", "failures",
                    "max_failures", "ranks", "started_at"):
            assert key in status, key
        assert [rank["rank"] for rank in status["ranks"]] == [0, 1]
        assert all("heartbeat_age_s" in rank and "memory_bytes" in rank for rank in status["ranks"])

        # a call without the token is refused; control.json does not carry it
        info = json.loads(control_file.read_text())
        assert "token" not in info and len(list((tmp_path / "tokens").iterdir())) == 1
        from rayzero.control_api.v1 import control_pb2, control_pb2_grpc

        with grpc.insecure_channel(info["address"]) as channel, pytest.raises(grpc.RpcError) as refused:
            control_pb2_grpc.ControlStub(channel).GetStatus(control_pb2.GetStatusRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

        # latencies, in-process client
        with rayzero.control_api.connect("e2e", storage=storage) as client:
            round_trips = []
            for _ in range(20):
                started = time.perf_counter()
                client.status()
                round_trips.append(time.perf_counter() - started)
            arrivals = []
            for _ in client.watch():
                arrivals.append(time.monotonic())
                if len(arrivals) == 6:
                    break
            started = time.monotonic()
            client.checkpoint_now(timeout_s=120)
            checkpoint_in_process_s = time.monotonic() - started
        watch_gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
        assert max(watch_gaps) <= 1.5, watch_gaps

        seen = _cli("status", "e2e", "--storage", storage, "--json", env=env)
        seen_step = json.loads(seen.stdout)["step"]
        started = time.monotonic()
        answer = _cli("checkpoint", "now", "e2e", "--storage", storage, "--json", env=env)
        checkpoint_s = time.monotonic() - started
        assert answer.returncode == 0, answer.stderr
        checkpoint = json.loads(answer.stdout)
        assert checkpoint["step"] >= seen_step
        location = checkpoint["location"].removeprefix("file://")
        assert os.path.isfile(os.path.join(location, "manifest.json")), checkpoint

        started = time.monotonic()
        answer = _cli("stop", "e2e", "--storage", storage, env=env)
        assert answer.returncode == 0, answer.stderr
        output, _ = driver.communicate(timeout=180)
        stop_s = time.monotonic() - started
        assert driver.returncode == 0, output
        first = control_driver.result(output)
        assert first["stopped"] is not False, output
        assert not control_file.exists() and list((tmp_path / "tokens").iterdir()) == []
        latest = (tmp_path / "runs" / "e2e" / "checkpoints" / "latest")
        assert latest.exists()
        final_step = int(latest.read_text().strip().removeprefix("global_step"))
        assert final_step >= checkpoint["step"]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)

    # The rerun in this process, a fresh driver for run "e2e" like the subprocess above (same settings;
    # an interpreter and its imports cheaper): it must resume from the stop's checkpoint.
    monkeypatch.setenv("RAYZERO_CONTROL_HOST", "127.0.0.1")
    monkeypatch.delenv("RAYZERO_CONTROL_TOKEN", raising=False)
    capsys.readouterr()
    control_driver.main("e2e", storage, str(final_step + 3))
    second = control_driver.result(capsys.readouterr().out)
    assert second["started_at"] == final_step, second  # resumed from the stop's checkpoint

    times = first["step_times"]
    step_s = statistics.median([b - a for a, b in itertools.pairwise(times)]) if len(times) > 2 else float("nan")
    figures = {"step_s": step_s, "status_round_trip_ms_median": 1000 * statistics.median(round_trips),
               "watch_interval_s_max": max(watch_gaps), "checkpoint_now_cli_s": checkpoint_s,
               "checkpoint_now_to_commit_s": checkpoint_in_process_s,
               "checkpoint_now_in_steps": checkpoint_in_process_s / step_s,
               "stop_to_exit_s": stop_s,
               "stop_to_exit_in_steps": stop_s / step_s}
    print("CONTROL FIGURES", json.dumps(figures))
