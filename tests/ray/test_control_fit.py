"""The control service inside a real `rayzero.fit` run on the shared local Ray: it is up while the run
lives (control.json on loopback as RAYZERO_CONTROL_HOST asks, without the token; the token in a 0600
file of the controller's node), refuses calls without the run's token, and is gone (control.json and
token file removed) when the run ends."""
from __future__ import annotations

import json
import os
import stat
import threading
import time

import grpc
import pytest

import rayzero
import rayzero.control_api
from rayzero.control_api.v1 import control_pb2, control_pb2_grpc


def waiting_loop(config):
    """Reports a step every 50 ms until the test drops the `go` file (or 60 s pass)."""
    import os
    import time

    deadline = time.monotonic() + 60
    step = 0
    open(config["started"], "w").close()
    while not os.path.exists(config["go"]) and time.monotonic() < deadline:
        rayzero.report({"step": step, "loss": 1.0 / (step + 1)})
        step += 1
        time.sleep(0.05)


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_the_run_serves_control_on_loopback_with_its_token_and_cleans_up(local_ray, tmp_path, monkeypatch):
    monkeypatch.setenv("RAYZERO_CONTROL_HOST", "127.0.0.1")
    monkeypatch.setenv("RAYZERO_CONTROL_TOKEN_DIR", str(tmp_path / "tokens"))  # reaches the controller actor
    go = tmp_path / "go"
    control_file = tmp_path / "runs" / "ctl" / "control.json"
    outcome = {}

    def run():
        try:
            outcome["result"] = rayzero.fit(
                waiting_loop, scaling=rayzero.ScalingConfig(num_workers=1),
                run=rayzero.RunConfig(name="ctl", storage=(tmp_path / "runs").as_uri(), progress_interval_s=60),
                train_loop_config={"go": str(go), "started": str(tmp_path / "started")})
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        _wait_for(control_file.exists, 60, "control.json")
        _wait_for((tmp_path / "started").exists, 60, "the loop to start")
        info = json.loads(control_file.read_text())
        assert info["address"].startswith("127.0.0.1:") and info["run_name"] == "ctl" and "token" not in info
        (token_file,) = (tmp_path / "tokens").iterdir()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        with rayzero.control_api.connect("ctl", storage=(tmp_path / "runs").as_uri()) as client:
            assert client.status().run_name == "ctl"
        with grpc.insecure_channel(info["address"]) as channel:
            stub = control_pb2_grpc.ControlStub(channel)
            for metadata in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.GetStatus(control_pb2.GetStatusRequest(), timeout=10, metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        go.touch()
        thread.join(60)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"].metrics_history
    assert not control_file.exists() and not token_file.exists()
    assert os.listdir(tmp_path / "runs" / "ctl")  # the run directory itself stays (metrics)
