"""Issue 22, section 2, outside Kubernetes: the control token's local file (0600, O_EXCL | O_NOFOLLOW,
a planted symlink or another user's file refused, a crashed run's file replaced), a token per
controller start, TLS with a private CA verified by name whatever address is dialled (pinned CA,
wrong CA, plaintext refused when a CA is pinned), and the warning for a plaintext bind beyond
loopback. Real gRPC servers on loopback over the in-process run of testkit/control_fake_run.py."""
from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys

import pytest
from testkit.control_fake_run import FakeRun, private_token_directory  # noqa: F401 (an autouse fixture)

from rayzero.config.errors import RayZeroRuntimeError
from rayzero.control_api import ControlClient, ControlError, connect
from rayzero.control_api.discovery import CONTROL_FILE
from rayzero.control_api.tls import fingerprint, make_service_certificates
from rayzero.control_api.tokens import token_path
from rayzero.controller.control_server import ControlServer, TlsFiles, is_loopback, plaintext_warning


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYZERO_CONTROL_HOST", "127.0.0.1")
    target = FakeRun("exp1", str(tmp_path / "ck"))
    yield target
    target.kill("test over")


def _write_certificates(directory, server_name):
    made = make_service_certificates(server_name)
    directory.mkdir()
    for name, text in (("ca.crt", made.ca_certificate), ("tls.crt", made.certificate), ("tls.key", made.private_key)):
        (directory / name).write_text(text)
    return made, TlsFiles(str(directory / "tls.crt"), str(directory / "tls.key"), str(directory / "ca.crt"))


def test_a_symlink_planted_at_the_token_path_is_refused_and_its_target_untouched(tmp_path, run):
    run_directory = (tmp_path / "exp1").as_uri()
    path = token_path(run_directory, "exp1")
    path.parent.mkdir(mode=0o700, parents=True)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path.symlink_to(victim)
    server = ControlServer(run, "exp1", run_directory)
    with pytest.raises(RayZeroRuntimeError, match=r"exists and is not a token file of this user.*nothing was written"):
        server.start()
    assert victim.read_text() == "precious" and path.is_symlink()
    assert not (tmp_path / "exp1" / CONTROL_FILE).exists()  # no service advertised without its token file
    with pytest.raises(ControlError), ControlClient(server.address, server.token, timeout_s=2) as client:
        client.status()  # and none serving


def test_a_crashed_runs_token_file_is_replaced_and_every_start_has_a_new_token(tmp_path, run):
    run_directory = (tmp_path / "exp1").as_uri()
    path = token_path(run_directory, "exp1")
    path.parent.mkdir(mode=0o700, parents=True)
    path.write_text("token-of-a-run-that-crashed\n")
    first = ControlServer(run, "exp1", run_directory).start()
    assert path.read_text() == first.token + "\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
    first.close(grace_s=0.1)
    second = ControlServer(run, "exp1", run_directory).start()  # the next attempt of the same run
    try:
        assert second.token != first.token and path.read_text() == second.token + "\n"
        with ControlClient(second.address, first.token, timeout_s=3) as stale, pytest.raises(ControlError) as refused:
            stale.status()
        assert refused.value.code == "UNAUTHENTICATED"
        with connect("exp1", storage=tmp_path.as_uri()) as client:  # found through the new token file
            assert client.status().run_name == "exp1"
    finally:
        second.close(grace_s=0.1)


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's file needs root")
def test_another_users_file_at_the_token_path_is_refused(tmp_path, run):
    run_directory = (tmp_path / "exp1").as_uri()
    path = token_path(run_directory, "exp1")
    path.parent.mkdir(mode=0o700, parents=True)
    path.write_text("theirs")
    os.chown(path, 4321, 4321)
    with pytest.raises(RayZeroRuntimeError, match="is not a token file of this user"):
        ControlServer(run, "exp1", run_directory).start()
    assert path.read_text() == "theirs"


def test_a_token_directory_others_can_enter_or_none_at_all_is_refused(
        tmp_path, run, monkeypatch, private_token_directory):  # noqa: F811
    private_token_directory.mkdir(mode=0o755)
    os.chmod(private_token_directory, 0o755)
    with pytest.raises(RayZeroRuntimeError, match=rf"chmod 700 {private_token_directory}"):
        ControlServer(run, "exp1", (tmp_path / "exp1").as_uri()).start()
    assert list(private_token_directory.iterdir()) == []
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("RAYZERO_CONTROL_TOKEN_DIR", str(tmp_path / "a-file" / "tokens"))  # cannot be made
    with pytest.raises(RayZeroRuntimeError, match="set RAYZERO_CONTROL_TOKEN_DIR to a private directory"):
        ControlServer(run, "exp1", (tmp_path / "exp1").as_uri()).start()


def test_a_given_token_is_not_written_anywhere(tmp_path, run, monkeypatch, private_token_directory):  # noqa: F811
    monkeypatch.setenv("RAYZERO_CONTROL_TOKEN", "from-the-job-secret-" + "x" * 24)
    server = ControlServer(run, "exp1", (tmp_path / "exp1").as_uri()).start()
    try:
        assert server.token.startswith("from-the-job-secret-") and server.token_file is None
        assert not private_token_directory.exists()
        assert server.token not in (tmp_path / "exp1" / CONTROL_FILE).read_text()
        with connect("exp1", storage=tmp_path.as_uri()) as client:  # the client takes it from the environment
            assert client.status().run_name == "exp1"
    finally:
        server.close(grace_s=0.1)


def test_tls_with_a_private_ca_is_verified_by_name_and_pinned(tmp_path, run, monkeypatch):
    name = "control.exp1.team-a.rayzero"  # an identity, not an address: clients dial 127.0.0.1
    made, files = _write_certificates(tmp_path / "tls", name)
    server = ControlServer(run, "exp1", (tmp_path / "exp1").as_uri(), tls=files).start()
    try:
        info = json.loads((tmp_path / "exp1" / CONTROL_FILE).read_text())
        assert (info["tls"], info["server_name"]) == (True, name)
        assert info["ca_fingerprint"] == fingerprint(made.ca_certificate) and "PRIVATE KEY" not in json.dumps(info)
        with connect("exp1", storage=tmp_path.as_uri()) as client:  # the CA from control.json
            assert client.status().run_name == "exp1"
        monkeypatch.setenv("RAYZERO_CONTROL_TLS_CA", files.ca)  # pinned, as in a RayZeroJob's pods
        with connect("exp1", storage=tmp_path.as_uri()) as client:
            assert client.status().run_name == "exp1"

        _, other_files = _write_certificates(tmp_path / "other", name)
        monkeypatch.setenv("RAYZERO_CONTROL_TLS_CA", other_files.ca)
        with pytest.raises(ControlError, match=r"uses the CA sha256:\w+, not the pinned CA") as refused:
            connect("exp1", storage=tmp_path.as_uri())
        assert refused.value.code == "FAILED_PRECONDITION"
        # By address, nothing to compare first: the handshake itself fails, naming the CA as the cause.
        with (connect(address=server.address, token=server.token, server_name=name, timeout_s=3) as client,
              pytest.raises(ControlError, match=r"TLS with 127\.0\.0\.1:\d+ failed.*Use the run's CA") as failed):
            client.status()
        assert failed.value.code == "UNAVAILABLE"
        monkeypatch.setenv("RAYZERO_CONTROL_TLS_CA", files.ca)
        with connect(address=server.address, token=server.token, server_name="control.other.team-a.rayzero",
                     timeout_s=3) as client, pytest.raises(ControlError, match="TLS with"):
            client.status()  # the right CA, but not the name this run's certificate carries
        assert run.scaled_to == [] and run.killed is None
    finally:
        server.close(grace_s=0.1)


def test_a_pinned_ca_refuses_a_plaintext_run(tmp_path, run, monkeypatch):
    _, files = _write_certificates(tmp_path / "tls", "rayzero-control")
    server = ControlServer(run, "exp1", (tmp_path / "exp1").as_uri()).start()  # no TLS
    try:
        monkeypatch.setenv("RAYZERO_CONTROL_TLS_CA", files.ca)
        with pytest.raises(ControlError, match="without TLS, but this client pins a CA.*not sent in plain text"):
            connect("exp1", storage=tmp_path.as_uri())
    finally:
        server.close(grace_s=0.1)


def test_plaintext_beyond_loopback_is_warned_about_with_the_way_to_turn_tls_on(tmp_path, run, caplog):
    assert [is_loopback(host) for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost")] == [True] * 5
    assert [is_loopback(host) for host in ("0.0.0.0", "10.1.2.3", "::", "node-7", "192.168.0.5")] == [False] * 5
    text = plaintext_warning("10.1.2.3:50051", "exp1")
    for part in ("without TLS", "python -m rayzero.control_api.tls --out DIR", "RAYZERO_CONTROL_TLS_CERT=DIR/tls.crt",
                 "RAYZERO_CONTROL_TLS_KEY=DIR/tls.key", "RAYZERO_CONTROL_TLS_CA=DIR/ca.crt", "RAYZERO_CONTROL_HOST"):
        assert part in text, part
    with caplog.at_level(logging.WARNING, logger="rayzero.controller.control_server"):
        server = ControlServer(run, "exp1", None).start()  # loopback: nothing to warn about
        server.close(grace_s=0.1)
    assert not [record for record in caplog.records if "without TLS" in record.getMessage()]


def test_the_certificate_tool_writes_a_private_key_and_never_overwrites(tmp_path):
    out = tmp_path / "certs"
    command = [sys.executable, "-m", "rayzero.control_api.tls", "--out", str(out), "--name", "trainer-1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE((out / "tls.key").stat().st_mode) == 0o600
    ca = (out / "ca.crt").read_text()
    assert fingerprint(ca) in done.stdout and (out / "tls.crt").read_text().endswith(ca)
    before = (out / "tls.key").read_text()
    again = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert again.returncode == 2 and "nothing was overwritten" in again.stderr
    assert (out / "tls.key").read_text() == before
