"""Bad RayZeroJobs: the apiserver refuses what the generated schema can say; the operator refuses the
rest with an InvalidSpec condition and Event naming the field and the fix, and creates nothing."""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from testkit.k8s_support import example, labelled_credentials, wait_for


def _with(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    spec = copy.deepcopy(example("minimal"))
    change(spec)
    return spec


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(spec: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return change


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda spec: spec.pop(key)


# (id, how the spec is broken, the field the apiserver must name)
SCHEMA_REJECTIONS = [
    ("replicas-zero", _set("workers.replicas", 0), "spec.workers.replicas"),
    ("replicas-string", _set("workers.replicas", "two"), "spec.workers.replicas"),
    ("pull-policy-enum", _set("imagePullPolicy", "Sometimes"), "spec.imagePullPolicy"),
    ("image-missing", _drop("image"), "spec.image"),
    ("entrypoint-missing", _drop("entrypoint"), "spec.entrypoint"),
    ("negative-restarts", _set("failurePolicy.maxRestarts", -1), "spec.failurePolicy.maxRestarts"),
    ("memory-not-a-quantity", _set("workers.resources.limits", {"memory": "lots"}),
     "spec.workers.resources.limits.memory"),
    ("durable-uri-no-scheme", _set("storage.durableUri", "my-bucket/runs"), "spec.storage.durableUri"),
    ("relative-host-path", _set("storage.nodeLocal", {"hostPath": "nvme"}), "spec.storage.nodeLocal.hostPath"),
    ("host-path-climbs-out", _set("storage.nodeLocal", {"hostPath": "/mnt/nvme/rayzero/../../../etc"}),
     "spec.storage.nodeLocal.hostPath"),
    ("host-path-root", _set("storage.nodeLocal", {"hostPath": "/"}), "spec.storage.nodeLocal.hostPath"),
    ("suspend-string", _set("suspend", "yes"), "spec.suspend"),
    ("ray-version", _set("rayVersion", "latest"), "spec.rayVersion"),
]


@pytest.mark.parametrize("change,field", [case[1:] for case in SCHEMA_REJECTIONS],
                         ids=[case[0] for case in SCHEMA_REJECTIONS])
def test_the_apiserver_refuses_what_the_schema_says(cluster, change, field):
    with pytest.raises(ApiException) as raised:
        cluster.create_job("bad", _with(change))
    assert raised.value.status == 422
    assert field in raised.value.body, raised.value.body


# (id, how the spec is broken, the field the InvalidSpec condition must name, a word of the fix)
OPERATOR_REJECTIONS = [
    ("min-above-replicas", _set("workers.minReplicas", 3), "spec.workers.minReplicas", "minReplicas <= 2"),
    ("max-below-replicas", _set("workers.maxReplicas", 1), "spec.workers.maxReplicas", "maxReplicas >= 2"),
    ("no-config", _set("deepspeed", {}), "spec.deepspeed", "keep one of"),
    ("two-configs", _set("deepspeed.configMapRef", {"name": "cm"}), "spec.deepspeed", "keep one of"),
    ("zero-stage", _set("deepspeed.config.zero_optimization", {"stage": 7}),
     "spec.deepspeed.config.zero_optimization.stage", "3"),
    ("batch-arithmetic", _set("deepspeed.config.train_batch_size", 3),
     "spec.deepspeed.config.train_batch_size", "train_micro_batch_size_per_gpu"),
    ("typo-kept-by-apiserver", _set("failurePolicy", {"maxRestart": 5}), "spec.failurePolicy.maxRestart",
     "did you mean `maxRestarts`"),
    ("missing-configmap", _set("deepspeed", {"configMapRef": {"name": "nowhere"}}),
     "spec.deepspeed.configMapRef", "create it"),
    # Issue 22: a job author gets no host directory outside allowedHostPaths (default /mnt/nvme/rayzero).
    ("host-path-etc", _set("storage.nodeLocal", {"hostPath": "/etc"}), "spec.storage.nodeLocal.hostPath",
     "allowedHostPaths"),
    ("host-path-beside-the-root", _set("storage.nodeLocal", {"hostPath": "/mnt/nvme/rayzero-other"}),
     "spec.storage.nodeLocal.hostPath", "allowedHostPaths"),
    ("mount-over-tmp", _set("storage.nodeLocal", {"hostPath": "/mnt/nvme/rayzero", "mountPath": "/tmp"}),
     "spec.storage.nodeLocal.mountPath", "another directory"),
    ("missing-credentials-secret", _set("storage.credentialsSecret", "nowhere"), "spec.storage.credentialsSecret",
     "rayzero.io/credentials=true"),
]


@pytest.mark.parametrize("change,field,fix", [case[1:] for case in OPERATOR_REJECTIONS],
                         ids=[case[0] for case in OPERATOR_REJECTIONS])
def test_the_operator_refuses_the_rest_and_creates_nothing(cluster, operator, change, field, fix):
    cluster.create_job("bad", _with(change))
    status = wait_for(cluster.phase_is("bad", "Failed"), what="phase Failed")
    condition = cluster.condition("bad", "InvalidSpec")
    assert condition["status"] == "True" and field in condition["message"] and fix in condition["message"]
    assert cluster.condition("bad", "Failed")["reason"] == "InvalidSpec"
    assert status["attempt"] == 0
    events = wait_for(lambda: [event for event in cluster.events("bad") if event.reason == "InvalidSpec"],
                      what="the InvalidSpec event")
    assert events[0].type == "Warning" and field in events[0].message
    assert cluster.ray_jobs("bad") == [] and cluster.config_map("bad-deepspeed") is None


def test_fixing_an_invalid_spec_starts_the_job(cluster, operator):
    cluster.create_job("fixme", _with(_set("workers.minReplicas", 3)))
    wait_for(cluster.phase_is("fixme", "Failed"), what="phase Failed")
    cluster.patch_job("fixme", {"spec": {"workers": {"minReplicas": 1}}})
    wait_for(lambda: cluster.ray_jobs("fixme"), what="the RayJob once the spec is fixed")
    wait_for(cluster.phase_is("fixme", "Pending"), what="phase Pending")
    assert cluster.condition("fixme", "InvalidSpec")["status"] == "False"
    (ray_job,) = cluster.ray_jobs("fixme")
    group = ray_job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (1, 2, 2)
    assert ray_job["spec"]["rayClusterSpec"]["enableInTreeAutoscaling"] is True


def test_a_configmap_config_is_validated_and_mounted(cluster, operator):
    spec = example("elastic")
    cluster.core.create_namespaced_config_map(cluster.namespace, {
        "metadata": {"name": "elastic-ds-config"},
        "data": {"ds_config.json": '{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 9}}'}})
    cluster.create_job("elastic", spec)
    wait_for(cluster.phase_is("elastic", "Failed"), what="InvalidSpec from the ConfigMap's content")
    assert "zero_optimization.stage" in cluster.condition("elastic", "InvalidSpec")["message"]

    cluster.core.patch_namespaced_config_map("elastic-ds-config", cluster.namespace, {
        "data": {"ds_config.json": '{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}'}})
    (ray_job,) = wait_for(lambda: cluster.ray_jobs("elastic"), what="the RayJob after the ConfigMap is fixed")
    group = ray_job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (2, 4, 8)
    volumes = {volume["name"]: volume for volume in group["template"]["spec"]["volumes"]}
    assert volumes["rayzero-config"]["configMap"] == {
        "name": "elastic-ds-config", "items": [{"key": "ds_config.json", "path": "ds_config.json"}]}
    claim = volumes["rayzero-node-local"]["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "local-nvme" and claim["resources"]["requests"]["storage"] == "500Gi"
    assert cluster.config_map("elastic-deepspeed") is None  # nothing generated for a referenced config


def test_a_foreign_configmap_of_the_generated_name_is_never_overwritten(cluster, operator):
    cluster.core.create_namespaced_config_map(cluster.namespace, {
        "metadata": {"name": "mine-deepspeed"}, "data": {"notes.txt": "a user's own data"}})
    cluster.create_job("mine", example("minimal"))
    wait_for(cluster.phase_is("mine", "Failed"), what="InvalidSpec for the name clash")
    assert "mine-deepspeed" in cluster.condition("mine", "InvalidSpec")["message"]
    assert cluster.config_map("mine-deepspeed").data == {"notes.txt": "a user's own data"}
    assert cluster.ray_jobs("mine") == []


def test_a_credentials_secret_must_be_marked_for_rayzerojobs(cluster, operator):
    """Issue 22: `storage.credentialsSecret` is the only Secret a job can bring into its pods, and only
    one its owner labelled for it: not any Secret of the namespace (a ServiceAccount's token, another
    job's control credentials)."""
    labelled_credentials(cluster, "plain", label=False)
    cluster.core.create_namespaced_service_account(cluster.namespace, {"metadata": {"name": "robot"}})
    labelled_credentials(cluster, "robot-token", type="kubernetes.io/service-account-token",
                         metadata={"name": "robot-token", "labels": {"rayzero.io/credentials": "true"},
                                   "annotations": {"kubernetes.io/service-account.name": "robot"}})
    cluster.create_job("victim", example("minimal"))
    victim_secret = wait_for(lambda: cluster.secret("victim-rayzero-auth"), what="the victim's Secret")
    cluster.core.patch_namespaced_secret("victim-rayzero-auth", cluster.namespace,
                                         {"metadata": {"labels": {"rayzero.io/credentials": "true"}}})
    for job, secret, why in (("thief-a", "plain", "is not marked for RayZeroJobs"),
                             ("thief-b", "robot-token", "only Opaque Secrets"),
                             ("thief-c", "victim-rayzero-auth", "one the rayzero operator made")):
        spec = example("minimal")
        spec["storage"] = {"credentialsSecret": secret}
        cluster.create_job(job, spec)
        wait_for(cluster.phase_is(job, "Failed"), what=f"{job} refused")
        message = cluster.condition(job, "InvalidSpec")["message"]
        assert "spec.storage.credentialsSecret" in message and why in message, message
        assert cluster.ray_jobs(job) == []
    assert cluster.secret("victim-rayzero-auth").data == victim_secret.data

    # Its owner marks it: the job starts, with that Secret as its environment.
    cluster.core.patch_namespaced_secret("plain", cluster.namespace,
                                         {"metadata": {"labels": {"rayzero.io/credentials": "true"}}})
    (ray_job,) = wait_for(lambda: cluster.ray_jobs("thief-a"), what="the RayJob once the Secret is marked")
    worker = ray_job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["envFrom"] == [{"secretRef": {"name": "plain"}}]
