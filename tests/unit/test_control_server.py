"""The control service for real: a gRPC server on loopback over a small in-process run (the
ControlTarget is the controller's; see testkit/control_fake_run.py), the Python client, auth, streaming,
control.json and TLS."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import time

import grpc
import pytest
from testkit.control_fake_run import FakeRun, private_token_directory, serving  # noqa: F401 (an autouse fixture)

from rayzero.config.errors import RayZeroRuntimeError
from rayzero.control_api import ControlClient, ControlError, ControlValueError, connect, status_dict
from rayzero.control_api.discovery import CONTROL_FILE
from rayzero.control_api.tokens import token_path
from rayzero.control_api.v1 import control_pb2, control_pb2_grpc
from rayzero.controller.control_server import ControlServer, watch_interval


@pytest.fixture
def served(tmp_path, monkeypatch):
    """(run, server, storage root) with control.json under <root>/exp1."""
    with serving(tmp_path, monkeypatch) as (run, server, root):
        yield run, server, root.as_uri()


def test_stubs_are_up_to_date():
    from rayzero.control_api.generate import stale

    assert stale() == [], "run `python -m rayzero.control_api.generate --write` after editing control.proto"


def test_control_json_names_the_address_not_the_token_which_goes_to_a_private_local_file(
        tmp_path, monkeypatch, private_token_directory):  # noqa: F811
    monkeypatch.setenv("RAYZERO_CONTROL_HOST", "127.0.0.1")
    run = FakeRun("exp1", str(tmp_path / "ck"))
    run_directory = (tmp_path / "exp1").as_uri()
    server = ControlServer(run, "exp1", run_directory).start()
    path = tmp_path / "exp1" / CONTROL_FILE
    text = path.read_text()
    info = json.loads(text)
    assert info["address"] == server.address and info["address"].startswith("127.0.0.1:")
    assert info["run_name"] == "exp1" and info["tls"] is False
    # [Note: the control token never goes to run storage]: not in the file, under no key
    assert len(server.token) >= 32 and server.token not in text and "token" not in info
    assert [p.name for p in (tmp_path / "exp1").iterdir()] == [CONTROL_FILE]  # no temporary left behind
    (token_file,) = private_token_directory.iterdir()
    assert token_file == token_path(run_directory, "exp1") and token_file.read_text() == server.token + "\n"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(private_token_directory.stat().st_mode) == 0o700
    server.close(grace_s=0.1)
    run.kill("done")
    assert not path.exists() and not token_file.exists()
    with pytest.raises(RayZeroRuntimeError,
                       match="no control.json for run 'exp1'.*not running"):
        connect("exp1", storage=tmp_path.as_uri())


def test_status_round_trip_carries_every_field(served):
    run, _, storage = served
    with connect("exp1", storage=storage) as client:
        time.sleep(0.15)
        status = client.status()
        record = client.checkpoint_now(timeout_s=10)
        after = status_dict(client.status())
    assert status.run_name == "exp1" and status.state == "running" and status.world_size == 2
    assert (status.min_workers, status.max_workers, status.max_failures) == (1, 4, 3)
    assert status.step >= 1 and status.HasField("loss") and status.loss == pytest.approx(2.0 / (1 + status.step))
    assert not status.HasField("tokens_per_s")
    assert [rank.rank for rank in status.ranks] == [0, 1] and status.ranks[1].memory_bytes == 1 << 20
    assert status.extra["backend"] == "gloo" and status.started_at == pytest.approx(run.started_at)
    # JSON: every field present, numbers as numbers, unknown optionals null
    for key in ("state", "attempt", "world_size", "min_workers", "max_workers", "step", "loss", "samples_per_s",
                "tokens_per_s", "checkpoints", "failures", "max_failures", "ranks", "started_at"):
        assert key in after, key
    assert after["tokens_per_s"] is None and isinstance(after["step"], int)
    assert after["checkpoints"] == [{"tier": "durable", "location": record.location, "step": record.step,
                                     "time": pytest.approx(record.time)}]
    assert isinstance(after["ranks"][0]["memory_bytes"], int)


def test_checkpoint_now_returns_a_committed_checkpoint_after_the_step_seen(served):
    run, _, storage = served
    with connect("exp1", storage=storage) as client:
        seen = client.status().step
        record = client.checkpoint_now(timeout_s=10)
    assert record.step > seen
    assert os.path.isfile(os.path.join(record.location, "manifest.json"))
    assert open(os.path.join(run.checkpoint_dir, "latest")).read() == f"global_step{record.step}"


def test_calls_without_or_with_a_wrong_token_are_unauthenticated(served):
    run, server, storage = served
    for token in ("", "not-the-token", server.token + "x"):
        with ControlClient(server.address, token) as client:
            for call in (client.status, lambda: client.checkpoint_now(5), lambda: client.scale(3),
                         lambda: client.kill("x"), lambda: client.stop(5), lambda: next(iter(client.watch()))):
                with pytest.raises(ControlError, match="refused the call") as refused:
                    call()
                assert refused.value.code == "UNAUTHENTICATED"
    # the raw protocol too: no metadata at all
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as error:
        control_pb2_grpc.ControlStub(channel).GetStatus(control_pb2.GetStatusRequest(), timeout=5)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert run.state == "running" and run.scaled_to == [] and run.killed is None  # nothing reached the run


def test_watch_streams_at_the_interval_until_the_run_ends(served):
    run, _, storage = served
    arrivals, states = [], []
    with connect("exp1", storage=storage) as client:
        for status in client.watch(interval_s=0.2):
            arrivals.append(time.monotonic())
            states.append(status.state)
            if len(arrivals) == 5:
                client.stop(timeout_s=10)
    assert states[-1] == "finished" and states[:5] == ["running"] * 5  # the interval: watch_interval's test


def test_watch_interval_is_as_asked_within_a_twentieth_and_one_second():
    assert watch_interval(0.2) == 0.2
    assert watch_interval(30) == 1.0  # at least one update a second, whatever was asked
    assert watch_interval(0.001) == 0.05
    assert watch_interval(0) == 0.5  # not given: the default


def test_stop_ends_the_run_after_a_final_checkpoint(served):
    run, _, storage = served
    with connect("exp1", storage=storage) as client:
        seen = client.status().step
        record = client.stop(timeout_s=10)
    assert record is not None and record.step > seen and run.state == "finished"


def test_scale_outside_the_range_is_invalid_argument_with_the_reason(served):
    run, _, storage = served
    with connect("exp1", storage=storage) as client:
        with pytest.raises(ControlValueError, match=r"outside the elastic range \[1, 4\]"):
            client.scale(9)
        client.scale(3)
        client.kill("enough")
        with pytest.raises(ControlError, match="is errored, not running") as refused:
            client.checkpoint_now(5)
    assert refused.value.code == "FAILED_PRECONDITION"
    assert run.scaled_to == [3] and run.killed == "enough"


def test_connect_by_address_and_token_file(served, tmp_path, monkeypatch):
    _, server, _ = served
    token_file = tmp_path / "token"
    token_file.write_text(server.token + "\n")
    with connect(address=server.address, token_file=str(token_file)) as client:
        assert client.status().run_name == "exp1"
    with pytest.raises(ValueError, match="needs token= or token_file="):
        connect(address=server.address)
    monkeypatch.setenv("RAYZERO_CONTROL_TOKEN", server.token)  # what a RayZeroJob's head pod has
    with connect(address=server.address) as client:
        assert client.status().run_name == "exp1"


def test_by_name_on_another_node_the_token_is_asked_for(served, tmp_path, monkeypatch):
    """control.json has no token: away from the controller's node (another token directory) the client
    says where the token is and how to pass it, and --token-file works."""
    _, server, storage = served
    monkeypatch.setenv("RAYZERO_CONTROL_TOKEN_DIR", str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match=r"no token for run 'exp1'.*--token-file FILE.*RAYZERO_CONTROL_TOKEN"):
        connect("exp1", storage=storage)
    copy = tmp_path / "copied-token"
    copy.write_text(server.token)
    with connect("exp1", storage=storage, token_file=str(copy)) as client:
        assert client.status().run_name == "exp1"


def test_a_stale_control_json_says_the_run_is_gone(served):
    _, server, storage = served
    server.close(grace_s=0.1)
    # put the file back as a crashed controller would leave it
    from rayzero.control_api.discovery import ControlInfo, write_control_file

    write_control_file(f"{storage}/exp1", ControlInfo(address=server.address))
    with connect("exp1", storage=storage, token=server.token, timeout_s=3) as client:
        with pytest.raises(ControlError, match="no control service answers.*ended or its control.json is stale"):
            client.status()


def _self_signed(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def test_tls_from_the_environment(tmp_path, monkeypatch):
    cert, key = _self_signed(tmp_path)
    monkeypatch.setenv("RAYZERO_CONTROL_HOST", "127.0.0.1")
    monkeypatch.setenv("RAYZERO_CONTROL_TLS_CERT", str(cert))
    monkeypatch.setenv("RAYZERO_CONTROL_TLS_KEY", str(key))
    run = FakeRun("secure", str(tmp_path / "ck"))
    server = ControlServer(run, "secure", (tmp_path / "secure").as_uri()).start()
    try:
        info = json.loads((tmp_path / "secure" / CONTROL_FILE).read_text())
        assert info["tls"] is True and "BEGIN CERTIFICATE" in info["root_certificates"]
        assert info["server_name"] == "localhost" and info["ca_fingerprint"].startswith("sha256:")
        with connect("secure", storage=tmp_path.as_uri()) as client:
            assert client.status().run_name == "secure"
        with ControlClient(server.address, server.token, timeout_s=3) as plain:  # plaintext to a TLS port
            with pytest.raises(ControlError):
                plain.status()
    finally:
        run.kill("done")
        server.close(grace_s=0.1)


def test_tls_needs_both_files(monkeypatch, tmp_path):
    from rayzero.controller.control_server import TlsFiles

    monkeypatch.setenv("RAYZERO_CONTROL_TLS_CERT", str(tmp_path / "cert.pem"))
    monkeypatch.delenv("RAYZERO_CONTROL_TLS_KEY", raising=False)
    with pytest.raises(ValueError, match="needs both RAYZERO_CONTROL_TLS_CERT and RAYZERO_CONTROL_TLS_KEY"):
        TlsFiles.from_env()


def test_a_taken_fixed_port_is_an_error_naming_the_variables(served, monkeypatch):
    run, server, _ = served
    port = server.address.rsplit(":", 1)[1]
    monkeypatch.setenv("RAYZERO_CONTROL_PORT", port)
    with pytest.raises(RayZeroRuntimeError, match=rf"could not bind 127.0.0.1:{port}.*RAYZERO_CONTROL_PORT"):
        ControlServer(run, "other", None).start()
