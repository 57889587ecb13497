"""`rayzero status|stop|scale|kill` and `rayzero checkpoint now` against a real control service on
loopback (over the in-process run of testkit/control_fake_run.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from testkit.control_fake_run import private_token_directory, serving  # noqa: F401 (an autouse fixture)

from rayzero.cli import main


@pytest.fixture
def served(tmp_path, monkeypatch):
    with serving(tmp_path, monkeypatch) as (run, server, root):
        time.sleep(0.15)  # a few steps
        yield run, server, str(root)


def test_status_json_from_another_process_with_the_default_storage(served):
    run, _, root = served
    # `rayzero run`'s default storage is ./runs: run the CLI from the directory holding runs/
    env = {key: value for key, value in os.environ.items() if key != "RAYZERO_STORAGE_ROOT"}
    time.monotonic()
    done = subprocess.run([sys.executable, "-m", "rayzero.cli", "status", "exp1", "--json"], cwd=os.path.dirname(root),
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["run_name"] == "exp1" and status["state"] == "running" and status["world_size"] == 2
    assert status["step"] >= 1 and status["loss"] == pytest.approx(2.0 / (1 + status["step"]))
    assert [rank["rank"] for rank in status["ranks"]] == [0, 1]


def test_status_table(served, capsys):
    _, _, root = served
    assert main(["status", "exp1", "--storage", root]) == 0
    out = capsys.readouterr().out
    assert "state running" in out and "elastic range 1-4" in out and "failures 0 of 3" in out
    assert "checkpoint none committed yet" in out
    assert "node0" in out and "1.0 MiB" in out


def test_checkpoint_now_then_stop(served, capsys):
    run, _, root = served
    assert main(["checkpoint", "now", "exp1", "--storage", root, "--json"]) == 0
    checkpoint = json.loads(capsys.readouterr().out)
    assert checkpoint["tier"] == "durable" and os.path.isfile(os.path.join(checkpoint["location"], "manifest.json"))
    assert main(["stop", "exp1", "--storage", root]) == 0
    assert f"stopped after checkpoint step {run.checkpoints[-1].step}" in capsys.readouterr().out
    assert run.state == "finished" and run.checkpoints[-1].step > checkpoint["step"]


def test_watch_json_lines_until_the_run_ends(served, capsys):
    run, _, root = served
    import threading

    threading.Timer(0.6, lambda: run.kill("over")).start()
    assert main(["status", "exp1", "--storage", root, "--watch", "--json", "--interval", "0.1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) >= 3 and lines[-1]["state"] == "errored"
    assert all(line["state"] == "running" for line in lines[:-1])


def test_scale_and_kill_by_address_and_token_file(served, tmp_path, capsys):
    run, server, _ = served
    token = tmp_path / "token"
    token.write_text(server.token)
    assert main(["scale", "--address", server.address, "--token-file", str(token), "3"]) == 0
    assert run.scaled_to == [3]
    assert main(["scale", "--address", server.address, "--token-file", str(token), "9"]) == 1
    assert "outside the elastic range [1, 4]" in capsys.readouterr().err
    assert main(["kill", "--address", server.address, "--token-file", str(token), "--reason", "bye"]) == 0
    assert run.killed == "bye"


def test_wrong_token_and_bad_arguments(served, tmp_path, capsys):
    _, server, root = served
    token = tmp_path / "token"
    token.write_text("guess")
    assert main(["status", "--address", server.address, "--token-file", str(token)]) == 1
    assert "refused the call: wrong bearer token" in capsys.readouterr().err
    assert main(["status", "--address", server.address]) == 2
    assert "--address needs --token-file" in capsys.readouterr().err
    assert main(["status", "--storage", str(tmp_path / "empty")]) == 1
    assert "no live run under" in capsys.readouterr().err
    assert main(["status", "other", "--storage", root]) == 1
    assert "no control.json for run 'other'" in capsys.readouterr().err
    assert main(["status", "a/b", "--storage", root]) == 2
    assert "= 'a/b' contains a path separator; use one plain directory name" in capsys.readouterr().err


def test_the_client_and_cli_import_neither_torch_nor_ray_nor_pyarrow():
    """The operator image has none of them, and `rayzero status` should start fast."""
    code = ("import sys, rayzero.control_api.client, rayzero.control_api.cli, rayzero_operator.control; "
            "bad = [m for m in ('torch', 'ray', 'pyarrow') if m in sys.modules]; assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_status_without_a_name_lists_the_live_runs(served, capsys):
    _, _, root = served
    assert main(["status", "--storage", root]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("exp1 ") and "running" in line and "workers 2" in line
    assert main(["status", "--storage", root, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["exp1"]["state"] == "running"


def test_away_from_the_controllers_node_the_token_comes_from_token_file(served, tmp_path, monkeypatch, capsys):
    """control.json holds no token: with no local token file `rayzero status NAME` says where it is;
    `--token-file` (a copy of it) or RAYZERO_CONTROL_TOKEN make it work."""
    _, server, root = served
    monkeypatch.setenv("RAYZERO_CONTROL_TOKEN_DIR", str(tmp_path / "another-node"))
    assert main(["status", "exp1", "--storage", root]) == 2
    err = capsys.readouterr().err
    assert "no token for run 'exp1'" in err and "--token-file" in err and server.token not in err
    copy = tmp_path / "token-copy"
    copy.write_text(server.token)
    assert main(["status", "exp1", "--storage", root, "--token-file", str(copy), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run_name"] == "exp1"
    monkeypatch.setenv("RAYZERO_CONTROL_TOKEN", server.token)
    assert main(["status", "--address", server.address, "--json"]) == 0
