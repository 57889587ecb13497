"""The operator, with the chart's ServiceAccount (RBAC enforced), against a real apiserver whose RayJob
schema is KubeRay v1.7.0's: RayZeroJob -> RayJob, status following, restarts, suspend, deletion."""
from __future__ import annotations

import datetime
import json
import time

import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from testkit.k8s_support import example, labelled_credentials, wait_for


def _uri_env(ray_job: dict) -> dict:
    return (yaml.safe_load(ray_job["spec"].get("runtimeEnvYAML") or "{}") or {}).get("env_vars", {})


def test_a_rayzerojob_becomes_the_expected_rayjob(cluster, operator):
    spec = example("zero3-offload")
    labelled_credentials(cluster, "s3-credentials")  # the example's credentialsSecret, marked for jobs
    created = cluster.create_job("llm", spec)

    ray_job = wait_for(lambda: cluster.ray_jobs("llm"), what="the RayJob")[0]
    assert [item["metadata"]["name"] for item in cluster.ray_jobs("llm")] == ["llm-attempt-1"]
    meta = ray_job["metadata"]
    assert meta["labels"]["rayzero.io/attempt"] == "1"
    owner = meta["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "RayZeroJob", "llm", created["metadata"]["uid"], True)

    job_spec = ray_job["spec"]
    assert job_spec["entrypoint"] == (
        "rayzero run train.py:train_loop --config /etc/rayzero/ds_config.json --workers 32 --gpus-per-worker 1 "
        "--storage s3://my-bucket/rayzero --name llm -- --model llama-7b --steps 20000")
    assert job_spec["backoffLimit"] == 0  # one retry budget: ours
    assert job_spec["shutdownAfterJobFinishes"] is True and job_spec["ttlSecondsAfterFinished"] == 600
    assert job_spec["suspend"] is False and "runtimeEnvYAML" not in job_spec  # first attempt: no resume

    cluster_spec = job_spec["rayClusterSpec"]
    assert cluster_spec["rayVersion"] == "2.60.0" and cluster_spec["enableInTreeAutoscaling"] is False
    head = cluster_spec["headGroupSpec"]["template"]["spec"]
    assert head["containers"][0]["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"}}
    (group,) = cluster_spec["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (4, 4, 4)
    pod = group["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "ghcr.io/rayzero/rayzero-worker:0.1.0"
    assert container["resources"]["limits"] == {"memory": "200Gi", "nvidia.com/gpu": 8}
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p4d.24xlarge"}
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["RAYZERO_NODE_LOCAL_DIR"] == "/mnt/rayzero-local"
    assert container["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}]
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert mounts == {"rayzero-config": "/etc/rayzero", "rayzero-node-local": "/mnt/rayzero-local",
                      "rayzero-tmp": "/tmp", "rayzero-control-tls": "/etc/rayzero-control"}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    # under the default allowedHostPaths; `Directory`: never created on the host by the kubelet
    assert volumes["rayzero-node-local"]["hostPath"] == {"path": "/mnt/nvme/rayzero", "type": "Directory"}
    assert volumes["rayzero-config"]["configMap"]["name"] == "llm-deepspeed"
    # Issue 22: what the pods run with, as stored by the apiserver through KubeRay's schema.
    for ray_pod in (head, pod):
        assert ray_pod["automountServiceAccountToken"] is False
        ray_container = ray_pod["containers"][0]
        assert ray_container["securityContext"]["readOnlyRootFilesystem"] is True
        scratch = {mount["mountPath"]: mount["name"] for mount in ray_container["volumeMounts"]}["/tmp"]
        assert {volume["name"]: volume for volume in ray_pod["volumes"]}[scratch] == {"name": scratch, "emptyDir": {}}
        assert [volume for volume in ray_pod["volumes"] if "hostPath" in volume] == (
            [] if ray_pod is head else [volumes["rayzero-node-local"]])
    head_env = {item["name"]: item.get("value") for item in head["containers"][0]["env"]}
    assert head_env["RAYZERO_NODE_LOCAL_DIR"] == "/mnt/rayzero-local"  # the controller runs on the head
    assert {"name": "rayzero-node-local", "emptyDir": {}} in head["volumes"]

    # The generated ConfigMap holds the inline config, owned by the job.
    config_map = cluster.config_map("llm-deepspeed")
    assert json.loads(config_map.data["ds_config.json"]) == spec["deepspeed"]["config"]
    assert config_map.metadata.owner_references[0].uid == created["metadata"]["uid"]

    status = wait_for(cluster.phase_is("llm", "Pending"), what="phase Pending")
    assert (status["rayJobName"], status["workers"], status["restarts"]) == ("llm-attempt-1", 4, 0)
    assert cluster.event("llm", "RayJobCreated")


def test_kuberay_schema_is_really_enforced(cluster, release):
    """The RayJob CRD installed here rejects what KubeRay's schema rejects, so the operator's RayJobs
    passing through it is a real check."""
    body = {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "bad"},
            "spec": {"entrypoint": 5, "shutdownAfterJobFinishes": "yes"}}
    with pytest.raises(ApiException) as raised:
        cluster.custom.create_namespaced_custom_object("ray.io", "v1", cluster.namespace, "rayjobs", body)
    assert raised.value.status == 422
    assert "spec.entrypoint" in raised.value.body and "spec.shutdownAfterJobFinishes" in raised.value.body


def test_status_follows_the_rayjob_to_success(cluster, operator):
    cluster.create_job("ok", example("minimal"))
    wait_for(lambda: cluster.ray_jobs("ok"), what="the RayJob")
    cluster.set_ray_job_status("ok-attempt-1", jobDeploymentStatus="Running", jobStatus="RUNNING")
    status = wait_for(cluster.phase_is("ok", "Running"), what="phase Running")
    assert cluster.condition("ok", "Ready")["status"] == "True"
    assert status["workers"] == 2

    cluster.set_ray_job_status("ok-attempt-1", jobDeploymentStatus="Complete", jobStatus="SUCCEEDED")
    wait_for(cluster.phase_is("ok", "Succeeded"), what="phase Succeeded")
    assert cluster.condition("ok", "Succeeded")["status"] == "True"
    assert cluster.condition("ok", "Ready")["status"] == "False"
    cluster.reconciled_again("ok")  # reconciles of a finished job start nothing
    assert len(cluster.ray_jobs("ok")) == 1


def test_a_failure_with_restarts_left_starts_exactly_one_resuming_rayjob(cluster, operator):
    spec = example("minimal")
    spec["storage"] = {"durableUri": "s3://bucket/runs"}
    # a backoff long enough to be seen on a loaded machine (BackingOff lasts as long as it)
    spec["failurePolicy"] = {"maxRestarts": 1, "backoffSeconds": 5}
    cluster.create_job("retry", spec)
    wait_for(lambda: cluster.ray_jobs("retry"), what="the first RayJob")
    cluster.set_ray_job_status("retry-attempt-1", jobDeploymentStatus="Running", jobStatus="RUNNING")
    wait_for(cluster.phase_is("retry", "Running"), what="phase Running")

    first_credentials = cluster.secret("retry-rayzero-auth")
    assert first_credentials.metadata.annotations["rayzero.io/control-attempt"] == "1"

    failed_at = time.monotonic()
    end_time = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    cluster.set_ray_job_status("retry-attempt-1", jobDeploymentStatus="Failed", jobStatus="FAILED",
                               reason="AppFailed", message="worker 3 ran out of memory", endTime=end_time)
    wait_for(lambda: cluster.condition("retry", "Ready").get("reason") == "BackingOff", what="backoff")
    assert len(cluster.ray_jobs("retry")) == 1  # not before backoffSeconds
    second = wait_for(lambda: len(cluster.ray_jobs("retry")) == 2 and cluster.ray_jobs("retry")[1],
                      what="attempt 2")
    assert time.monotonic() - failed_at >= 4.0  # backoffSeconds 5, timestamps have 1 s resolution
    rotated = cluster.secret("retry-rayzero-auth")  # before its RayJob: the new pods read these
    assert second["metadata"]["name"] == "retry-attempt-2"
    assert _uri_env(second) == {"RAYZERO_RESUME_FROM": "s3://bucket/runs/retry"}
    status = wait_for(lambda: cluster.status("retry").get("attempt") == 2 and cluster.status("retry"),
                      what="status of attempt 2")
    assert (status["phase"], status["restarts"], status["rayJobName"]) == ("Restarting", 1, "retry-attempt-2")
    assert status["resumeFrom"] == "s3://bucket/runs/retry"
    cluster.reconciled_again("retry")  # further events and resyncs make no third RayJob
    assert len(cluster.ray_jobs("retry")) == 2
    # A new attempt, new control credentials (made once: resyncs did not rotate them again); Ray's
    # token, which KubeRay's submitter also holds, stays.
    second_credentials = cluster.secret("retry-rayzero-auth")
    assert second_credentials.metadata.annotations["rayzero.io/control-attempt"] == "2"
    assert second_credentials.data == rotated.data
    for key in ("control_token", "ca.crt", "tls.crt", "tls.key"):
        assert second_credentials.data[key] != first_credentials.data[key], key
    assert second_credentials.data["auth_token"] == first_credentials.data["auth_token"]

    cluster.set_ray_job_status("retry-attempt-2", jobDeploymentStatus="Running", jobStatus="RUNNING")
    wait_for(cluster.phase_is("retry", "Running"), what="attempt 2 running")
    cluster.set_ray_job_status("retry-attempt-2", jobDeploymentStatus="Failed", jobStatus="FAILED",
                               message="NCCL timeout")
    status = wait_for(cluster.phase_is("retry", "Failed"), what="phase Failed")
    failed = cluster.condition("retry", "Failed")
    assert failed["reason"] == "RestartsExhausted" and "NCCL timeout" in failed["message"]
    assert status["restarts"] == 1
    cluster.reconciled_again("retry")
    assert len(cluster.ray_jobs("retry")) == 2
    assert any(event.type == "Warning" for event in cluster.event("retry", "RestartsExhausted"))


def test_no_restarts_means_a_failure_is_final(cluster, operator):
    spec = example("minimal")
    spec["failurePolicy"] = {"maxRestarts": 0}
    cluster.create_job("once", spec)
    wait_for(lambda: cluster.ray_jobs("once"), what="the RayJob")
    cluster.set_ray_job_status("once-attempt-1", jobDeploymentStatus="Failed", jobStatus="FAILED")
    wait_for(cluster.phase_is("once", "Failed"), what="phase Failed")
    cluster.reconciled_again("once")
    assert len(cluster.ray_jobs("once")) == 1


def test_suspend_and_resume(cluster, operator):
    spec = example("minimal")
    spec["storage"] = {"durableUri": "gs://b/p"}
    cluster.create_job("pause", spec)
    wait_for(lambda: cluster.ray_jobs("pause"), what="the RayJob")
    cluster.set_ray_job_status("pause-attempt-1", jobDeploymentStatus="Running", jobStatus="RUNNING")
    wait_for(cluster.phase_is("pause", "Running"), what="phase Running")

    cluster.patch_job("pause", {"spec": {"suspend": True}})
    wait_for(lambda: cluster.ray_job("pause-attempt-1")["spec"]["suspend"] is True, what="RayJob suspended")
    wait_for(cluster.phase_is("pause", "Suspended"), what="phase Suspended")
    assert cluster.condition("pause", "Suspended")["status"] == "True"
    cluster.set_ray_job_status("pause-attempt-1", jobDeploymentStatus="Suspended", jobStatus="STOPPED")
    # KubeRay's "STOPPED" of a suspended job is not a failure
    assert cluster.reconciled_again("pause")["phase"] == "Suspended" and len(cluster.ray_jobs("pause")) == 1

    cluster.patch_job("pause", {"spec": {"suspend": False}})
    wait_for(lambda: cluster.ray_job("pause-attempt-1")["spec"]["suspend"] is False, what="RayJob resumed")
    resumed = cluster.ray_job("pause-attempt-1")
    assert _uri_env(resumed) == {"RAYZERO_RESUME_FROM": "gs://b/p/pause"}
    cluster.set_ray_job_status("pause-attempt-1", jobDeploymentStatus="Running", jobStatus="RUNNING")
    wait_for(cluster.phase_is("pause", "Running"), what="running again")
    assert len(cluster.ray_jobs("pause")) == 1 and cluster.status("pause")["restarts"] == 0


def test_created_suspended_starts_suspended(cluster, operator):
    spec = example("minimal")
    spec["suspend"] = True
    cluster.create_job("later", spec)
    ray_job = wait_for(lambda: cluster.ray_jobs("later"), what="the RayJob")[0]
    assert ray_job["spec"]["suspend"] is True
    wait_for(cluster.phase_is("later", "Suspended"), what="phase Suspended")


def test_deletion_goes_through_the_finalizer(cluster, operator_process, operator):
    cluster.create_job("gone", example("minimal"))
    wait_for(lambda: cluster.ray_jobs("gone"), what="the RayJob")
    job = wait_for(lambda: "rayzero.io/finalizer" in (cluster.job("gone")["metadata"].get("finalizers") or [])
                   and cluster.job("gone"), what="the finalizer")
    uid = job["metadata"]["uid"]
    # No garbage collector runs here: what makes deletion cascade in a cluster is these references.
    for owned in [*cluster.ray_jobs("gone"), cluster.config_map("gone-deepspeed").to_dict()]:
        meta = owned["metadata"]
        refs = meta.get("ownerReferences") or meta.get("owner_references")
        assert [(ref.get("uid"), ref.get("kind")) for ref in refs] == [(uid, "RayZeroJob")]

    operator_process.stop()  # with no operator the finalizer holds the job
    cluster.delete_job("gone")  # nothing but the operator could remove its finalizer: no waiting needed
    held = cluster.job("gone")
    assert held is not None and held["metadata"].get("deletionTimestamp")
    assert len(cluster.ray_jobs("gone")) == 1

    operator_process.start()
    wait_for(lambda: cluster.job("gone") is None, what="the RayZeroJob to go")
    assert cluster.ray_jobs("gone") == [] and cluster.config_map("gone-deepspeed") is None


def test_rbac_is_enough_and_no_more(cluster, operator, operator_kubeconfig):
    from kubernetes import client, config

    # the operator's own work here (a ConfigMap, a RayJob, a status), so the logs checked below hold
    # API calls whichever tests ran before
    cluster.create_job("rbac", example("minimal"))
    wait_for(lambda: cluster.ray_jobs("rbac"), what="the RayJob")

    as_operator = config.new_client_from_config(config_file=str(operator_kubeconfig))
    core = client.CoreV1Api(as_operator)
    for forbidden in (lambda: core.list_namespaced_secret(cluster.namespace),
                      lambda: core.create_namespaced_pod(cluster.namespace, {
                          "metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}),
                      lambda: client.CustomObjectsApi(as_operator).delete_namespaced_custom_object(
                          "rayzero.io", "v1alpha1", cluster.namespace, "rayzerojobs", "any")):
        with pytest.raises(ApiException) as raised:
            forbidden()
        assert raised.value.status == 403
    # Everything this and the other tests made the operator do went through without a refusal.
    logs = operator.all_logs()
    assert "POST /apis/ray.io/v1/namespaces/" in logs  # the logs hold the operator's API calls
    refusals = [line for line in logs.splitlines()
                if "Forbidden" in line or "forbidden" in line or '" 403 ' in line or "(403)" in line]
    assert refusals == []
