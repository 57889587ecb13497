"""The operator and the control plane: what it generates for Ray's and rayzero's tokens and for pod
security (pure), and, on the real apiserver, the operator reading a run's status and asking for
checkpoint-now, scale and a stop before suspend through a real gRPC control service on loopback
(the RayJob's status set by the test, as KubeRay would)."""
from __future__ import annotations

import base64
import json
import os
import pathlib
import sys

import k8s_envtest
from k8s_support import example, wait_for
from rayzero_operator import manifests
from rayzero_operator.control import control_address

from rayzero.config.k8s_job import RayZeroJobSpec
from rayzero.controller.control_server import ControlServer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "unit"))
from control_fake_run import FakeRun


def _job(spec: dict | None = None) -> dict:
    return {"metadata": {"name": "j", "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": spec or example("minimal")}


def _env(container: dict) -> dict:
    return {item["name"]: item.get("value") or item.get("valueFrom") for item in container["env"]}


def test_tokens_come_from_the_job_secret_and_pods_run_unprivileged():
    job = _job()
    spec = RayZeroJobSpec.model_validate(job["spec"])
    ray_job = manifests.ray_job(job, spec, 1, None)
    cluster = ray_job["spec"]["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token", "secretName": "j-rayzero-auth"}
    head_pod = cluster["headGroupSpec"]["template"]["spec"]
    worker_pod = cluster["workerGroupSpecs"][0]["template"]["spec"]
    for pod in (head_pod, worker_pod):
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
        container = pod["containers"][0]
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                                 "capabilities": {"drop": ["ALL"]}}
        env = _env(container)
        assert env["RAY_AUTH_MODE"] == "token"
        assert env["RAY_AUTH_TOKEN"] == {"secretKeyRef": {"name": "j-rayzero-auth", "key": "auth_token"}}
    head_env = _env(head_pod["containers"][0])
    assert head_env["RAYZERO_CONTROL_TOKEN"] == {"secretKeyRef": {"name": "j-rayzero-auth", "key": "control_token"}}
    assert head_env["RAYZERO_CONTROL_PORT"] == "50051"
    assert {"containerPort": 50051, "name": "rayzero-control"} in head_pod["containers"][0]["ports"]
    assert "RAYZERO_CONTROL_TOKEN" not in _env(worker_pod["containers"][0])  # only the controller needs it
    assert worker_pod["terminationGracePeriodSeconds"] == 120

    secret = manifests.auth_secret(job)
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    tokens = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    assert set(tokens) == {"auth_token", "control_token"} and tokens["auth_token"] != tokens["control_token"]
    assert all(len(token) >= 40 for token in tokens.values())
    assert not any(token in json.dumps(ray_job) for token in tokens.values())  # never in the RayJob

    custom = example("minimal")
    custom["workers"]["terminationGracePeriodSeconds"] = 300
    custom["head"] = {"controlPort": 6000}
    spec = RayZeroJobSpec.model_validate(custom)
    other = manifests.ray_job(_job(custom), spec, 1, None)["spec"]["rayClusterSpec"]
    assert other["workerGroupSpecs"][0]["template"]["spec"]["terminationGracePeriodSeconds"] == 300
    assert _env(other["headGroupSpec"]["template"]["spec"]["containers"][0])["RAYZERO_CONTROL_PORT"] == "6000"


def test_control_address_from_the_rayjob_status():
    spec = RayZeroJobSpec.model_validate(example("minimal"))
    ray_job = {"status": {}}
    assert control_address(ray_job, spec, "ns") is None  # KubeRay has not reported the head yet
    ray_job["status"]["rayClusterName"] = "j-attempt-1-abcde"
    assert control_address(ray_job, spec, "ns") == "j-attempt-1-abcde-head-svc.ns.svc:50051"
    ray_job["status"]["rayClusterStatus"] = {"head": {"serviceName": "c-head-svc"}}
    assert control_address(ray_job, spec, "ns") == "c-head-svc.ns.svc:50051"
    ray_job["status"]["rayClusterStatus"] = {"head": {"serviceIP": "10.0.0.7", "podIP": "10.1.0.3"},
                                             "endpoints": {"rayzero-control": "7000", "dashboard": "8265"}}
    assert control_address(ray_job, spec, "ns") == "10.0.0.7:7000"


def test_the_operator_reads_status_and_drives_checkpoint_scale_and_suspend(cluster, operator, tmp_path):
    port = k8s_envtest.free_port()
    spec = example("minimal")
    spec["head"] = {"controlPort": port}
    spec["workers"].update(minReplicas=1, maxReplicas=4)
    cluster.create_job("ctl", spec)
    wait_for(lambda: cluster.ray_jobs("ctl"), what="the RayJob")
    secret = wait_for(lambda: cluster.secret("ctl-rayzero-auth"), what="the token Secret")
    assert secret.metadata.owner_references[0].name == "ctl"
    token = base64.b64decode(secret.data["control_token"]).decode()

    run = FakeRun("ctl", str(tmp_path / "checkpoints"), world_size=2, step_s=0.05)
    server = ControlServer(run, "ctl", None, host="127.0.0.1", port=port, token=token).start()
    try:
        # Play KubeRay: the job runs and the head Service's address is known.
        cluster.set_ray_job_status("ctl-attempt-1", jobDeploymentStatus="Running", jobStatus="RUNNING",
                                   rayClusterStatus={"head": {"serviceIP": "127.0.0.1"},
                                                     "endpoints": {"rayzero-control": str(port)}})
        status = wait_for(lambda: (s := cluster.status("ctl")) and (s.get("step") or 0) >= 1 and s, 30,
                          "the step in the status")
        assert status["phase"] == "Running" and status["runState"] == "running"
        assert (status["worldSize"], status["failures"]) == (2, 0) and status["loss"] > 0
        assert status.get("lastCheckpoint") is None

        cluster.patch_job("ctl", {"metadata": {"annotations": {"rayzero.io/checkpoint-now": "first"}}})
        status = wait_for(lambda: (s := cluster.status("ctl")).get("checkpointRequest") == "first" and s, 30,
                          "checkpoint-now carried out")
        assert len(run.checkpoints) == 1 and status["lastCheckpointStep"] == run.checkpoints[0].step
        assert os.path.isfile(os.path.join(status["lastCheckpoint"], "manifest.json"))
        assert any(event.reason == "CheckpointCommitted" for event in cluster.events("ctl"))

        cluster.patch_job("ctl", {"spec": {"workers": {"replicas": 3}}})
        wait_for(lambda: run.scaled_to == [3], 30, "Scale(3) to reach the run")
        wait_for(lambda: cluster.status("ctl").get("worldSize") == 3, 30, "the new world size in the status")
        assert run.scaled_to == [3]  # asked once, not on every resync

        seen = run.step
        cluster.patch_job("ctl", {"spec": {"suspend": True}})
        wait_for(lambda: cluster.ray_job("ctl-attempt-1")["spec"]["suspend"] is True, 30, "RayJob suspended")
        # Stop came first: the run committed a final checkpoint and ended before the suspend.
        assert run.state == "finished" and run.checkpoints[-1].step > seen and len(run.checkpoints) == 2
        status = wait_for(lambda: (s := cluster.status("ctl")).get("phase") == "Suspended" and s, 30, "Suspended")
        assert status["lastCheckpointStep"] == run.checkpoints[-1].step
        assert any(event.reason == "StoppedForSuspend" for event in cluster.events("ctl"))
    finally:
        run.kill("test over")
        server.close(grace_s=0.5)


def test_the_operator_keeps_the_status_when_the_run_cannot_be_reached(cluster, operator):
    spec = example("minimal")
    spec["head"] = {"controlPort": k8s_envtest.free_port()}  # nothing listens there
    cluster.create_job("gone", spec)
    wait_for(lambda: cluster.ray_jobs("gone"), what="the RayJob")
    cluster.set_ray_job_status("gone-attempt-1", jobDeploymentStatus="Running", jobStatus="RUNNING",
                               rayClusterStatus={"head": {"serviceIP": "127.0.0.1"}})
    status = wait_for(cluster.phase_is("gone", "Running"), 30, "phase Running")
    assert status.get("step") is None and status.get("controlTime") is None
