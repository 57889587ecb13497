"""The fault matrix on S3 storage, through a real S3 endpoint on loopback (moto's server, started from
the `.venv-s3` that `make s3-venv` builds: its botocore and this venv's kubernetes client need
incompatible python-dateutil versions). The run's checkpoints live only on S3 (staged locally, then
committed there); a worker is killed and the restart must resume from the newest checkpoint committed
on S3 — not from step 0 — and a same-name rerun goes on from there too."""
from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from test_faults import _check_continued, _signalling_rank1
from testkit import elastic_loop

from rayzero.ports import server_port

MOTO_SERVER = Path(__file__).resolve().parents[2] / ".venv-s3" / "bin" / "moto_server"
BUCKET = "rayzero-faults"

pytestmark = pytest.mark.skipif(not MOTO_SERVER.exists(),
                                reason=f"no {MOTO_SERVER}: run `make s3-venv` (moto's S3 server in its own venv)")


@pytest.fixture
def s3_ray(monkeypatch, tmp_path, _session_cluster):
    """moto's S3 server on 127.0.0.1, and this process connected to the shared Ray with the AWS
    variables pointing at it, in this process and as the job's runtime_env: the controller, the relays
    and the workers inherit them, as they would a node's environment (Ray merges env_vars down to
    every actor; a Ray of its own started with them cost a whole Ray start-up). Disconnected after the
    test, so the next test that needs the shared Ray joins it without them."""
    import ray

    port = server_port()  # bound by the server later: [Note: ports below the ephemeral range]
    log = (tmp_path / "moto.log").open("wb")  # the server's whole life; closed in finally
    server = subprocess.Popen([str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "moto.log").read_text()
                time.sleep(0.1)
        aws = {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
        for key, value in aws.items():
            monkeypatch.setenv(key, value)
        import pyarrow.fs as pafs

        pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
                          allow_bucket_creation=True).create_dir(BUCKET)
        if ray.is_initialized():
            ray.shutdown()
        ray.init(address=_session_cluster.address, logging_level="WARNING", runtime_env={"env_vars": aws})
        yield ray
    finally:
        if ray.is_initialized():
            ray.shutdown()
        server.terminate()
        server.wait(10)
        log.close()


def _committed_on_s3() -> list[int]:
    from rayzero.controller import committed_checkpoints

    return sorted(found.record.step for found in committed_checkpoints.committed_in(f"s3://{BUCKET}/runs/s3run/checkpoints"))


def _fit(loop_config: dict, **failure):
    import rayzero

    return rayzero.fit(
        elastic_loop.train, config=elastic_loop.config(), scaling=rayzero.ScalingConfig(num_workers=2),
        run=rayzero.RunConfig(name="s3run", storage=f"s3://{BUCKET}/runs", progress_interval_s=30),
        failure=rayzero.FailureConfig(**failure), train_loop_config=loop_config)


def test_a_killed_worker_resumes_from_the_newest_checkpoint_committed_on_s3(s3_ray, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    config = {"steps": 12, "sleep": 0.1, "save_every": 3, "pid_dir": str(pids)}
    # SIGKILLed once a checkpoint is committed on S3
    result = _signalling_rank1(lambda: _fit(config, max_failures=1, backoff_s=0), pids, signal.SIGKILL,
                               ready=_committed_on_s3, join_s=300)
    assert result.failures == 1
    history = [m for m in result.metrics_history if "step" in m]
    resumed = [m for m in history if m["attempt"] == max(m["attempt"] for m in history)]
    assert resumed[0]["started_at"] >= 3  # from S3, not from step 0
    _check_continued(result, 12, lost_at_most=2)
    assert _committed_on_s3()[-1] == 12 and result.checkpoint_step == 12

    # a same-name rerun finds the run on S3 and goes on from its newest checkpoint there
    rerun = _fit({"steps": 15, "save_every": 3})
    steps = [m for m in rerun.metrics_history if "started_at" in m]
    last = [m for m in steps if m["attempt"] == steps[-1]["attempt"]]
    assert last[0]["started_at"] == 12 and [m["step"] for m in last] == [13, 14, 15]
    final = [m for m in rerun.metrics_history if "final" in m][-1]
    assert final["final"] == pytest.approx(elastic_loop.reference_weights(15), abs=1e-5)
