"""No stale-cluster or silent-restart traps (issue 13 item 5). Each test fails on the code before the
fix: the stale record was joined (minutes of hanging), a cluster rayzero started waited out the
120 s placement timeout, a gone address hung in ray.init, Ray's token warning printed on every run,
and re-run steps appeared twice in metrics_history."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

from testkit import crash_loop

import rayzero
from rayzero.driver.metrics_store import read_metrics

DEAD = "127.0.0.1:9"  # discard port: nothing listens there


def _isolated_env(tmp_path) -> dict[str, str]:
    """A fresh Ray temp dir (short path: Ray's socket names) holding a record of a gone cluster, and a
    fresh HOME (its own ~/.ray/auth_token), with no address asked for."""
    ray_tmp = tempfile.mkdtemp(prefix="rz", dir="/tmp")
    os.makedirs(os.path.join(ray_tmp, "ray"))
    with open(os.path.join(ray_tmp, "ray", "ray_current_cluster"), "w") as record:
        record.write(DEAD)
    env = {key: value for key, value in os.environ.items()
           if key not in ("RAY_ADDRESS", "RAYZERO_ADDRESS", "RAY_AUTH_MODE")}
    env.update(RAY_TMPDIR=ray_tmp, HOME=str(tmp_path))
    return env


OWN_CLUSTER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import rayzero
    from rayzero.driver import cli

    open("ok.py", "w").write("def f(config):\\n    pass\\n")
    open("ds.json", "w").write('{"train_micro_batch_size_per_gpu": 1}')
    started = time.monotonic()
    code = cli.main(["ok.py:f", "--config", "ds.json", "--workers", "64", "--storage", "runs"])
    print("TOO_MANY", code, round(time.monotonic() - started, 1), flush=True)


    def loop():
        rayzero.report({"step": 0})


    for _ in range(2):
        result = rayzero.fit(loop, scaling=rayzero.ScalingConfig(num_workers=1),
                             run=rayzero.RunConfig(storage="runs"))
        print("FIT", result.metrics, flush=True)
    """
)


def test_a_stale_record_is_not_joined_a_too_big_request_fails_at_once_and_no_token_note_for_our_own_ray(tmp_path):
    (tmp_path / "script.py").write_text(OWN_CLUSTER_SCRIPT)
    done = subprocess.run([sys.executable, "script.py"], check=False, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=_isolated_env(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out, err = done.stdout, done.stderr
    too_many = next(line for line in out.splitlines() if line.startswith("TOO_MANY"))
    _, code, seconds = too_many.split()
    # rayzero started this Ray (the record points at a gone cluster): it can never grow, so fail now
    assert code == "2", err
    message = next(line for line in err.splitlines() if line.startswith("rayzero run:"))
    assert "64 worker(s)" in message and "room for" in message and "--workers" in message
    assert out.count("FIT {'step': 0}") == 2
    # a Ray that rayzero starts (and ends) itself: nobody logs in to it, so no token note (issue 21)
    assert "Ray token authentication is on for this cluster" not in out
    assert "starting a local Ray on this machine" in out
    assert "Token authentication is enabled" not in err  # Ray's own per-process warning is held back


def test_a_gone_cluster_that_was_asked_for_is_reported_in_seconds(tmp_path):
    (tmp_path / "ok.py").write_text("def f(config):\n    pass\n")
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1}')
    for address, shown in (("auto", f"{DEAD} (RAY_ADDRESS=auto)"), (DEAD, f"{DEAD} (RAY_ADDRESS={DEAD})")):
        env = dict(_isolated_env(tmp_path), RAY_ADDRESS=address)
        done = subprocess.run([sys.executable, "-m", "rayzero.cli", "run", "ok.py:f", "--config", "ds.json"],
                              check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
        assert done.returncode == 2, done.stderr[-3000:]
        assert f"no Ray cluster answers at {shown}" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_re_run_steps_appear_once_in_metrics_history_and_the_log(local_ray, tmp_path, capsys):
    # rank 1 crashes after step 3; the rerun starts at 2, as if the checkpoint were at step 2
    result = rayzero.fit(crash_loop.restarting_loop, scaling=rayzero.ScalingConfig(num_workers=2),
                         train_loop_config={"steps": 5, "crash_after": 3, "resume_at": 2},
                         run=rayzero.RunConfig(storage=tmp_path.as_uri(), name="r", progress_interval_s=0),
                         failure=rayzero.FailureConfig(max_failures=1))
    assert [m["step"] for m in result.metrics_history] == [0, 1, 2, 3, 4]
    assert [m["attempt_seen"] for m in result.metrics_history] == [0, 0, 1, 1, 1]
    table = read_metrics(str(tmp_path / "r")).to_pydict()
    rows = sorted(zip(table["rank"], table["step"], table["attempt"]))
    assert rows == [(rank, step, int(step >= 2)) for rank in (0, 1) for step in range(5)]
    assert "step 2 (restarted: " in capsys.readouterr().out
