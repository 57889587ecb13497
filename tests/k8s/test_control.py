"""The operator and the control plane: what it generates for Ray's and rayzero's tokens, the control
service's TLS and pod security (pure), and, on the real apiserver, the operator reading a run's status
and asking for checkpoint-now, scale and a stop before suspend through a real gRPC control service on
loopback serving TLS with the certificate from the job's Secret, verified against the Secret's CA
(the RayJob's status set by the test, as KubeRay would)."""
from __future__ import annotations

import base64
import json
import os

import pytest
from cryptography import x509
from rayzero_operator import manifests
from rayzero_operator.control import control_address
from testkit.control_fake_run import FakeRun
from testkit.k8s_support import example, head_tls_files, wait_for

from rayzero.config.k8s_job import RayZeroJobSpec
from rayzero.control_api import ControlClient, ControlError
from rayzero.control_api.tls import make_service_certificates
from rayzero.controller.control_server import ControlServer
from scripts import k8s_envtest


def _job(spec: dict | None = None) -> dict:
    return {"metadata": {"name": "j", "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": spec or example("minimal")}


def _env(container: dict) -> dict:
    return {item["name"]: item.get("value") or item.get("valueFrom") for item in container["env"]}


def _mounts(container: dict) -> dict:
    return {mount["mountPath"]: mount for mount in container["volumeMounts"]}


def test_tokens_and_tls_come_from_the_job_secret_and_pods_run_unprivileged_on_a_read_only_root():
    job = _job()
    spec = RayZeroJobSpec.model_validate(job["spec"])
    ray_job = manifests.ray_job(job, spec, 1, None)
    cluster = ray_job["spec"]["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token", "secretName": "j-rayzero-auth"}
    head_pod = cluster["headGroupSpec"]["template"]["spec"]
    worker_pod = cluster["workerGroupSpecs"][0]["template"]["spec"]
    for pod in (head_pod, worker_pod):
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
        assert pod["automountServiceAccountToken"] is False  # training code gets no API credentials
        container = pod["containers"][0]
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                                 "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        mounts = _mounts(container)
        assert volumes[mounts["/tmp"]["name"]] == {"name": "rayzero-tmp", "emptyDir": {}}  # Ray's /tmp/ray
        assert not any(volume.get("hostPath") for volume in pod["volumes"])
        env = _env(container)
        assert env["RAY_AUTH_MODE"] == "token"
        assert env["RAY_AUTH_TOKEN"] == {"secretKeyRef": {"name": "j-rayzero-auth", "key": "auth_token"}}
        assert env["RAYZERO_CONTROL_TLS_CA"] == "/etc/rayzero-control/ca.crt"
        assert mounts["/etc/rayzero-control"]["readOnly"] is True
    head_tls = {volume["name"]: volume for volume in head_pod["volumes"]}["rayzero-control-tls"]["secret"]
    worker_tls = {volume["name"]: volume for volume in worker_pod["volumes"]}["rayzero-control-tls"]["secret"]
    assert head_tls["secretName"] == worker_tls["secretName"] == "j-rayzero-auth" and head_tls["defaultMode"] == 0o440
    assert [item["key"] for item in head_tls["items"]] == ["ca.crt", "tls.crt", "tls.key"]
    assert [item["key"] for item in worker_tls["items"]] == ["ca.crt"]  # the private key only where it serves
    head_env = _env(head_pod["containers"][0])
    assert head_env["RAYZERO_CONTROL_TOKEN"] == {"secretKeyRef": {"name": "j-rayzero-auth", "key": "control_token"}}
    assert head_env["RAYZERO_CONTROL_PORT"] == "50051"
    assert (head_env["RAYZERO_CONTROL_TLS_CERT"], head_env["RAYZERO_CONTROL_TLS_KEY"]) == (
        "/etc/rayzero-control/tls.crt", "/etc/rayzero-control/tls.key")
    assert {"containerPort": 50051, "name": "rayzero-control"} in head_pod["containers"][0]["ports"]
    assert "RAYZERO_CONTROL_TOKEN" not in _env(worker_pod["containers"][0])  # only the controller needs it
    assert worker_pod["terminationGracePeriodSeconds"] == 120
    assert "autoscalerOptions" not in cluster  # no autoscaler, no API token anywhere

    secret = manifests.auth_secret(job, 1)
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert secret["metadata"]["annotations"] == {"rayzero.io/control-attempt": "1"}
    data = {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}
    assert set(data) == {"auth_token", "control_token", "ca.crt", "tls.crt", "tls.key"}
    assert data["auth_token"] != data["control_token"] and min(map(len, (data["auth_token"], data["control_token"]))) >= 40
    ca = x509.load_pem_x509_certificate(data["ca.crt"].encode())
    served = x509.load_pem_x509_certificate(data["tls.crt"].encode())
    served.verify_directly_issued_by(ca)
    assert served.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == [manifests.control_server_name("j", "ns")] == ["control.j.ns.rayzero"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    text = json.dumps(ray_job)
    assert not any(value in text for key, value in data.items() if key != "ca.crt")  # never in the RayJob
    assert manifests.auth_secret(job, 1)["data"]["control_token"] != secret["data"]["control_token"]

    custom = example("minimal")
    custom["workers"]["terminationGracePeriodSeconds"] = 300
    custom["head"] = {"controlPort": 6000}
    spec = RayZeroJobSpec.model_validate(custom)
    other = manifests.ray_job(_job(custom), spec, 1, None)["spec"]["rayClusterSpec"]
    assert other["workerGroupSpecs"][0]["template"]["spec"]["terminationGracePeriodSeconds"] == 300
    assert _env(other["headGroupSpec"]["template"]["spec"]["containers"][0])["RAYZERO_CONTROL_PORT"] == "6000"


def test_an_elastic_jobs_autoscaler_alone_gets_the_service_account_token():
    spec = example("minimal")
    spec["workers"].update(minReplicas=1, maxReplicas=4)
    cluster = manifests.ray_job(_job(spec), RayZeroJobSpec.model_validate(spec), 1, None)["spec"]["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is True
    head_pod = cluster["headGroupSpec"]["template"]["spec"]
    assert head_pod["automountServiceAccountToken"] is False
    (token_volume,) = [volume for volume in head_pod["volumes"] if "projected" in volume]
    sources = token_volume["projected"]["sources"]
    assert sources[0] == {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}}
    assert cluster["autoscalerOptions"]["volumeMounts"] == [{
        "name": token_volume["name"], "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": True}]
    assert token_volume["name"] not in {mount["name"] for mount in head_pod["containers"][0]["volumeMounts"]}


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


def test_the_operator_reads_status_and_drives_checkpoint_scale_and_suspend_over_verified_tls(
        cluster, operator, tmp_path):
    port = k8s_envtest.server_port()
    spec = example("minimal")
    spec["head"] = {"controlPort": port}
    spec["workers"].update(minReplicas=1, maxReplicas=4)
    cluster.create_job("ctl", spec)
    wait_for(lambda: cluster.ray_jobs("ctl"), what="the RayJob")
    secret = wait_for(lambda: cluster.secret("ctl-rayzero-auth"), what="the token Secret")
    assert secret.metadata.owner_references[0].name == "ctl"
    token = base64.b64decode(secret.data["control_token"]).decode()

    # The control service as the head pod runs it: the job Secret's token and TLS certificate, which
    # names the job (control.ctl.<namespace>.rayzero), not the address the operator dials.
    run = FakeRun("ctl", str(tmp_path / "checkpoints"), world_size=2, step_s=0.05)
    server = ControlServer(run, "ctl", None, host="127.0.0.1", port=port, token=token,
                           tls=head_tls_files(secret, tmp_path / "tls")).start()
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

        # The operator got there over TLS it verified; a client trusting another CA for the same name,
        # or speaking plain text, gets nothing.
        name = manifests.control_server_name("ctl", cluster.namespace)
        impostor_ca = make_service_certificates(name).ca_certificate
        with (ControlClient(f"127.0.0.1:{port}", token, tls=True, root_certificates=impostor_ca, server_name=name,
                            timeout_s=5) as wrong_ca,
              pytest.raises(ControlError, match=r"TLS with 127\.0\.0\.1:\d+ failed")):
            wrong_ca.status()
        with ControlClient(f"127.0.0.1:{port}", token, timeout_s=5) as plain, pytest.raises(ControlError):
            plain.status()
        ca = base64.b64decode(secret.data["ca.crt"]).decode()
        with ControlClient(f"127.0.0.1:{port}", token, tls=True, root_certificates=ca, server_name=name) as right:
            assert right.status().run_name == "ctl"

        cluster.patch_job("ctl", {"metadata": {"annotations": {"rayzero.io/checkpoint-now": "first"}}})
        status = wait_for(lambda: (s := cluster.status("ctl")).get("checkpointRequest") == "first" and s, 30,
                          "checkpoint-now carried out")
        assert len(run.checkpoints) == 1 and status["lastCheckpointStep"] == run.checkpoints[0].step
        assert os.path.isfile(os.path.join(status["lastCheckpoint"], "manifest.json"))
        assert cluster.event("ctl", "CheckpointCommitted")

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
        assert cluster.event("ctl", "StoppedForSuspend")
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
