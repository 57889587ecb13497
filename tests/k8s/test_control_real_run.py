"""The operator against a real rayzero run: `rayzero.fit` in a subprocess (its own local Ray) serves
its control service on loopback with the port, token and TLS certificate the operator put in the job
(the head pod's RAYZERO_CONTROL_PORT / RAYZERO_CONTROL_TOKEN / RAYZERO_CONTROL_TLS_*); the operator,
verifying the certificate against the job Secret's CA, copies the run's step and loss into the
RayZeroJob's status, and `spec.suspend` stops the run with a final checkpoint (the run exits 0)."""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile

from testkit import control_driver
from testkit.k8s_support import example, head_tls_files, wait_for

from scripts import k8s_envtest


def test_the_operator_follows_and_suspends_a_real_run(cluster, operator, tmp_path):
    port = k8s_envtest.server_port()
    spec = example("minimal")
    spec["head"] = {"controlPort": port}
    cluster.create_job("real", spec)
    wait_for(lambda: cluster.ray_jobs("real"), what="the RayJob")
    secret = wait_for(lambda: cluster.secret("real-rayzero-auth"), what="the token Secret")
    token = base64.b64decode(secret.data["control_token"]).decode()
    tls = head_tls_files(secret, tmp_path / "tls")

    ray_tmp = tempfile.mkdtemp(prefix="rzk8s", dir="/tmp")  # Ray's socket paths must stay short
    # What the operator's head pod gives the run: the port, the job Secret's token and TLS files.
    env = {**os.environ, "RAYZERO_CONTROL_HOST": "127.0.0.1", "RAYZERO_CONTROL_PORT": str(port),
           "RAYZERO_CONTROL_TOKEN": token, "RAYZERO_CONTROL_TLS_CERT": tls.certificate,
           "RAYZERO_CONTROL_TLS_KEY": tls.private_key, "RAYZERO_CONTROL_TLS_CA": tls.ca, "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    driver = subprocess.Popen([sys.executable, str(control_driver.PATH), "real", (tmp_path / "runs").as_uri(),
                               "100000", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        cluster.set_ray_job_status("real-attempt-1", jobDeploymentStatus="Running", jobStatus="RUNNING",
                                   rayClusterStatus={"head": {"serviceIP": "127.0.0.1"}})
        # The driver starts a local Ray first, retried up to three times when a busy machine makes it
        # miss Ray's start-up bounds ([Note: Ray's start-up bounds]): the bound covers those tries, and
        # a driver that exits fails the wait at once with its output.
        def stepped() -> dict | None:
            if driver.poll() is not None:
                raise AssertionError(f"the run's driver exited ({driver.returncode}):\n{driver.stdout.read()}")
            return (s := cluster.status("real")) and (s.get("step") or 0) >= 2 and s

        status = wait_for(stepped, 360, "the run's step in the RayZeroJob status")
        assert status["runState"] == "running" and status["worldSize"] == 1 and status["loss"] is not None
        info = json.loads((tmp_path / "runs" / "real" / "control.json").read_text())
        assert info["tls"] is True and info["server_name"] == f"control.real.{cluster.namespace}.rayzero"
        assert token not in json.dumps(info)

        cluster.patch_job("real", {"spec": {"suspend": True}})
        wait_for(lambda: cluster.ray_job("real-attempt-1")["spec"]["suspend"] is True, 120, "RayJob suspended")
        output, _ = driver.communicate(timeout=120)
        assert driver.returncode == 0 and control_driver.result(output)["stopped"], output
        latest = tmp_path / "runs" / "real" / "checkpoints" / "latest"
        assert latest.exists(), output  # the loop never saves: this is the stop's checkpoint
        final = int(latest.read_text().strip().removeprefix("global_step"))
        status = wait_for(lambda: (s := cluster.status("real")).get("phase") == "Suspended" and s, 30, "Suspended")
        assert status["lastCheckpointStep"] == final >= status["step"] - 1
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
        shutil.rmtree(ray_tmp, ignore_errors=True)
