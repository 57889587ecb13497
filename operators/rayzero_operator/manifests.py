"""The objects one RayZeroJob attempt is made of: a ConfigMap and a KubeRay RayJob (pure functions).

Every object carries an owner reference to the RayZeroJob (so the garbage collector deletes it with
the job) and the labels the operator finds it by. [Note: one RayJob per attempt] The RayJob of attempt
n is always named `<job>-attempt-<n>`: two reconciles that decide to start the same attempt (a
duplicate event, an operator restarted mid-reconcile) create the same name, and the apiserver lets
only one of them succeed. The attempt numbers of existing RayJobs are the operator's memory of
restarts, so it survives the loss of the RayZeroJob's status.
"""
from __future__ import annotations

import base64
import json
import secrets
import shlex
from typing import Any

import yaml

from rayzero.config.environment import (
    CONTROL_PORT,
    CONTROL_TLS_CA,
    CONTROL_TLS_CERT,
    CONTROL_TLS_KEY,
    CONTROL_TOKEN,
    NODE_LOCAL_DIR,
    RESUME_FROM,
)
from rayzero.config.k8s_job import (
    CONFIG_FILE_NAME,
    CONFIG_MOUNT_DIR,
    GROUP,
    KIND,
    VERSION,
    RayZeroJobSpec,
    Resources,
)

MANAGED_BY = "rayzero-operator"
LABEL_JOB = f"{GROUP}/job"
LABEL_ATTEMPT = f"{GROUP}/attempt"
RAY_GROUP, RAY_VERSION, RAY_PLURAL = "ray.io", "v1", "rayjobs"
WORKER_GROUP = "workers"
CONFIG_VOLUME = "rayzero-config"
NODE_LOCAL_VOLUME = "rayzero-node-local"
DEFAULT_NODE_LOCAL_MOUNT = "/mnt/rayzero-local"
# [Note: the job's tokens] One Secret per RayZeroJob, created by the operator and owned by the job,
# holds `auth_token` for Ray's own token authentication (KubeRay's key name, so
# `authOptions.secretName` can point at it and KubeRay's job submitter authenticates too), made once
# per job, and the control service's credentials, made again for every attempt (RayJob):
# `control_token` (the bearer token the operator sends to read status and ask for checkpoints, stops
# and scaling) and the service's TLS material, `ca.crt`, `tls.crt`, `tls.key` ([Note: control-plane
# TLS] in rayzero/control_api/tls.py). The annotation `rayzero.io/control-attempt` says which attempt
# they belong to, so a restarted operator never rotates them twice. None of it is ever in a RayJob or
# a status: pods read the tokens through secretKeyRef and the TLS files from a Secret volume (the
# key on the head only), and control.json never holds the token.
RAY_TOKEN_KEY, CONTROL_TOKEN_KEY = "auth_token", "control_token"
CA_KEY, CERT_KEY, PRIVATE_KEY_KEY = "ca.crt", "tls.crt", "tls.key"
CONTROL_ATTEMPT_ANNOTATION = f"{GROUP}/control-attempt"
CONTROL_TLS_VOLUME = "rayzero-control-tls"
CONTROL_TLS_DIR = "/etc/rayzero-control"
SCRATCH_VOLUME, SCRATCH_DIR = "rayzero-tmp", "/tmp"
SERVICE_ACCOUNT_TOKEN_VOLUME = "kube-api-access-autoscaler"
CONTROL_PORT_NAME = "rayzero-control"
RAY_USER_ID, RAY_GROUP_ID = 1000, 100  # the `ray` user of Ray's images and of workers/Dockerfile
# KubeRay copies the RayJob name into label values (at most 63 characters): leave room for
# "-attempt-" and a 4-digit attempt number.
MAX_JOB_NAME_LENGTH = 63 - len("-attempt-") - 4


def ray_job_name(job_name: str, attempt: int) -> str:
    """The deterministic name of attempt `attempt` (see [Note: one RayJob per attempt])."""
    return f"{job_name}-attempt-{attempt}"


def auth_secret_name(job_name: str) -> str:
    """The Secret holding the job's tokens ([Note: the job's tokens])."""
    return f"{job_name}-rayzero-auth"


def control_server_name(job_name: str, namespace: str) -> str:
    """The DNS name in the control service's certificate: an identity the operator verifies whatever
    address it dials (the head's Service IP changes with every attempt)."""
    return f"control.{job_name}.{namespace}.rayzero"


def _encoded(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def control_credentials(job: dict[str, Any]) -> dict[str, str]:
    """Fresh control-service credentials for one attempt, as Secret `data` (base64): a token, and a CA
    made for this attempt with the certificate it signed for the job's control name."""
    from rayzero.control_api.tls import make_service_certificates

    meta = job["metadata"]
    made = make_service_certificates(control_server_name(meta["name"], meta["namespace"]))
    return {CONTROL_TOKEN_KEY: _encoded(secrets.token_urlsafe(32)), CA_KEY: _encoded(made.ca_certificate),
            CERT_KEY: _encoded(made.certificate), PRIVATE_KEY_KEY: _encoded(made.private_key)}


def auth_secret(job: dict[str, Any], attempt: int) -> dict[str, Any]:
    """The job's Secret as attempt `attempt` needs it ([Note: the job's tokens]). When it exists, only
    the control credentials are replaced, and only for a newer attempt (KubeApi.create)."""
    meta = job["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {**owned_metadata(job, auth_secret_name(meta["name"]), labels(meta["name"])),
                     "annotations": {CONTROL_ATTEMPT_ANNOTATION: str(attempt)}},
        "data": {RAY_TOKEN_KEY: _encoded(secrets.token_urlsafe(32)), **control_credentials(job)},
    }


def config_map_name(job_name: str) -> str:
    """The ConfigMap the operator writes an inline DeepSpeed config into."""
    return f"{job_name}-deepspeed"


def resume_uri(spec: RayZeroJobSpec, job_name: str) -> str | None:
    """Where the run's checkpoints live durably: `rayzero run --storage URI --name NAME` writes them
    under URI/NAME, so a retried attempt resumes from there. None without durable storage."""
    if spec.storage.durable_uri is None:
        return None
    return f"{spec.storage.durable_uri.rstrip('/')}/{job_name}"


def owner_reference(job: dict[str, Any]) -> dict[str, Any]:
    meta = job["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        # Foreground deletion of the RayZeroJob waits for its RayJobs (and their clusters).
        "blockOwnerDeletion": True,
    }


def owned_metadata(job: dict[str, Any], name: str, object_labels: dict[str, str]) -> dict[str, Any]:
    """The metadata of an object the operator makes for `job`: in its namespace, owned by it."""
    return {"name": name, "namespace": job["metadata"]["namespace"], "labels": object_labels,
            "ownerReferences": [owner_reference(job)]}


def labels(job_name: str, attempt: int | None = None) -> dict[str, str]:
    result = {"app.kubernetes.io/managed-by": MANAGED_BY, "app.kubernetes.io/part-of": "rayzero",
              LABEL_JOB: job_name}
    if attempt is not None:
        result[LABEL_ATTEMPT] = str(attempt)
    return result


def config_map(job: dict[str, Any], spec: RayZeroJobSpec) -> dict[str, Any]:
    """The generated ConfigMap holding an inline DeepSpeed config as `ds_config.json`."""
    meta = job["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": owned_metadata(job, config_map_name(meta["name"]), labels(meta["name"])),
        "data": {CONFIG_FILE_NAME: json.dumps(spec.deepspeed.config, indent=2, sort_keys=True) + "\n"},
    }


def entrypoint(spec: RayZeroJobSpec, job_name: str) -> str:
    """The `rayzero run` command line the RayJob submits (shell-quoted: KubeRay runs it in a shell).

    `--workers` is the world size: one rank per GPU of every worker pod (one per pod without GPUs).
    `--max-failures` is left to `rayzero run`'s default: inside the RayJob the controller restarts
    its worker group after a lost worker or node as long as the run keeps committing checkpoints (no
    total limit; 3 failures in a row without a newer checkpoint end it), on the Ray cluster it
    already has; what ends the RayJob is left to the operator's restart budget ([Note: one retry
    budget] in plan.py)."""
    command = ["rayzero", "run", spec.entrypoint.target,
               "--config", f"{CONFIG_MOUNT_DIR}/{CONFIG_FILE_NAME}",
               "--workers", str(spec.world_size())]
    if spec.gpus_per_worker() > 0:
        command += ["--gpus-per-worker", "1"]  # one rank per GPU
    if spec.storage.durable_uri is not None:
        command += ["--storage", spec.storage.durable_uri]
    command += ["--name", job_name]
    if spec.entrypoint.args:
        command += ["--", *spec.entrypoint.args]
    return shlex.join(command)


def runtime_env_yaml(resume_from: str | None) -> str | None:
    """Ray runtime env of the driver: how RAYZERO_RESUME_FROM reaches `rayzero run`."""
    if resume_from is None:
        return None
    return yaml.safe_dump({"env_vars": {RESUME_FROM.name: resume_from}}, sort_keys=True)


def _resources(resources: Resources) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if resources.requests:
        out["requests"] = {key: value for key, value in resources.requests.items()}
    if resources.limits:
        out["limits"] = {key: value for key, value in resources.limits.items()}
    return out


def _config_volume(spec: RayZeroJobSpec, job_name: str) -> dict[str, Any]:
    ref = spec.deepspeed.config_map_ref
    if ref is None:
        return {"name": CONFIG_VOLUME, "configMap": {"name": config_map_name(job_name)}}
    # Whatever the key in the user's ConfigMap, `rayzero run --config` finds it as ds_config.json.
    return {"name": CONFIG_VOLUME,
            "configMap": {"name": ref.name, "items": [{"key": ref.key, "path": CONFIG_FILE_NAME}]}}


def _node_local_volume(spec: RayZeroJobSpec) -> dict[str, Any]:
    local = spec.storage.node_local
    if local is None:
        return {"name": NODE_LOCAL_VOLUME, "emptyDir": {}}
    if local.host_path is not None:
        # `Directory`, not `DirectoryOrCreate`: the node's administrator prepares it (workers/README.md);
        # a typo fails the pod instead of making directories as root on the host. Which roots a job may
        # name at all is the operator's allowedHostPaths (spec.py).
        return {"name": NODE_LOCAL_VOLUME, "hostPath": {"path": local.host_path, "type": "Directory"}}
    return {"name": NODE_LOCAL_VOLUME, "ephemeral": {"volumeClaimTemplate": {"spec": {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": local.storage_class_name,
        "resources": {"requests": {"storage": local.size}},
    }}}}


def _control_tls_volume(job_name: str, head: bool) -> dict[str, Any]:
    """The attempt's control TLS files from the job's Secret: the private key only on the head (the
    controller serves there), the CA everywhere (`rayzero status` in any pod pins it). 0440 with the
    pods' fsGroup: readable by the `ray` user's group, nobody else."""
    keys = (CA_KEY, CERT_KEY, PRIVATE_KEY_KEY) if head else (CA_KEY,)
    return {"name": CONTROL_TLS_VOLUME, "secret": {"secretName": auth_secret_name(job_name), "defaultMode": 0o440,
                                                   "items": [{"key": key, "path": key} for key in keys]}}


def _container(spec: RayZeroJobSpec, job_name: str, name: str, resources: Resources, *,
               head: bool) -> dict[str, Any]:
    mount_path = spec.storage.node_local.mount_path if spec.storage.node_local else DEFAULT_NODE_LOCAL_MOUNT
    # The head gets the variable too: the rayzero controller runs there and tells workers where to write.
    env = [{"name": NODE_LOCAL_DIR.name, "value": mount_path},
           {"name": CONTROL_TLS_CA.name, "value": f"{CONTROL_TLS_DIR}/{CA_KEY}"}]
    # The root filesystem is read-only; Ray writes its sessions, logs and sockets under /tmp/ray
    # (its default temp dir), Python's tempfile and torch's caches under /tmp: an emptyDir there.
    mounts = [{"name": CONFIG_VOLUME, "mountPath": CONFIG_MOUNT_DIR, "readOnly": True},
              {"name": NODE_LOCAL_VOLUME, "mountPath": mount_path},
              {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_DIR},
              {"name": CONTROL_TLS_VOLUME, "mountPath": CONTROL_TLS_DIR, "readOnly": True}]
    # Ray's token authentication: every Ray process and client in the cluster needs the token
    # (KubeRay sets the same from authOptions; set here too so the pods never run without it).
    secret = auth_secret_name(job_name)
    env += [{"name": "RAY_AUTH_MODE", "value": "token"},
            {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": RAY_TOKEN_KEY}}}]
    if head:
        # The controller's control service: a fixed port the head Service exposes, the attempt's
        # token, and TLS with the attempt's certificate ([Note: the job's tokens]).
        env += [{"name": CONTROL_PORT.name, "value": str(spec.head.control_port)},
                {"name": CONTROL_TOKEN.name, "valueFrom": {"secretKeyRef": {
                    "name": secret, "key": CONTROL_TOKEN_KEY}}},
                {"name": CONTROL_TLS_CERT.name, "value": f"{CONTROL_TLS_DIR}/{CERT_KEY}"},
                {"name": CONTROL_TLS_KEY.name, "value": f"{CONTROL_TLS_DIR}/{PRIVATE_KEY_KEY}"}]
    container: dict[str, Any] = {
        "name": name,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "env": env,
        "volumeMounts": mounts,
        "resources": _resources(resources),
        "securityContext": {"allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    if spec.storage.credentials_secret is not None:
        # The only Secret a job author can bring, and only one labelled for it (spec.py).
        container["envFrom"] = [{"secretRef": {"name": spec.storage.credentials_secret}}]
    return container


def _pod_spec(spec: RayZeroJobSpec, job_name: str, container: dict[str, Any], *, head: bool) -> dict[str, Any]:
    """Ray pods run as the image's non-root `ray` user, volumes group-writable through fsGroup, and
    without the namespace's ServiceAccount token: training code has no business with the API."""
    # The head trains nothing: scratch space only, never a node-local claim.
    node_local = {"name": NODE_LOCAL_VOLUME, "emptyDir": {}} if head else _node_local_volume(spec)
    return {
        "containers": [container],
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RAY_USER_ID, "runAsGroup": RAY_GROUP_ID,
                            "fsGroup": RAY_GROUP_ID, "seccompProfile": {"type": "RuntimeDefault"}},
        "volumes": [_config_volume(spec, job_name), node_local, {"name": SCRATCH_VOLUME, "emptyDir": {}},
                    _control_tls_volume(job_name, head)],
    }


def _autoscaler_token_volume() -> dict[str, Any]:
    """What the ServiceAccount admission plugin would mount in every container, for KubeRay's
    autoscaler sidecar alone (autoscalerOptions.volumeMounts): it scales the RayCluster through the
    API with the ServiceAccount KubeRay gives the head; the Ray container never sees the token."""
    return {"name": SERVICE_ACCOUNT_TOKEN_VOLUME, "projected": {"defaultMode": 0o444, "sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1",
                                                                      "fieldPath": "metadata.namespace"}}]}},
    ]}}


def ray_job(job: dict[str, Any], spec: RayZeroJobSpec, attempt: int,
            resume_from: str | None) -> dict[str, Any]:
    """The KubeRay RayJob of one attempt; `resume_from` is set from the second attempt on."""
    meta = job["metadata"]
    name = meta["name"]
    low, high = spec.world_bounds()
    head = _container(spec, name, "ray-head", spec.head.resources, head=True)
    head["ports"] = [{"containerPort": 6379, "name": "gcs-server"},
                     {"containerPort": 8265, "name": "dashboard"},
                     {"containerPort": 10001, "name": "client"},
                     {"containerPort": spec.head.control_port, "name": CONTROL_PORT_NAME}]
    head_pod = _pod_spec(spec, name, head, head=True)
    worker_pod = _pod_spec(spec, name, _container(spec, name, "ray-worker", spec.workers.resources,
                                                  head=False), head=False)
    # time for the planned stop to commit the current step on SIGTERM
    worker_pod["terminationGracePeriodSeconds"] = spec.workers.termination_grace_period_seconds
    if spec.workers.node_selector:
        worker_pod["nodeSelector"] = dict(spec.workers.node_selector)
    ray_job_spec: dict[str, Any] = {
        "entrypoint": entrypoint(spec, name),
        # [Note: one retry budget] KubeRay's retries would recreate the cluster without resuming and
        # stack with ours; the operator counts restarts and starts a fresh RayJob that resumes.
        "backoffLimit": 0,
        "shutdownAfterJobFinishes": True,
        "suspend": spec.suspend,
        "rayClusterSpec": {
            "rayVersion": spec.ray_version,
            # Elastic jobs let the Ray autoscaler add workers up to maxReplicas.
            "enableInTreeAutoscaling": low < high,
            # Ray token authentication ([Note: the job's tokens]) instead of an open dashboard.
            "authOptions": {"mode": "token", "secretName": auth_secret_name(name)},
            "headGroupSpec": {
                "rayStartParams": {"dashboard-host": "0.0.0.0"},
                "template": {"metadata": {"labels": labels(name, attempt)}, "spec": head_pod},
            },
            "workerGroupSpecs": [{
                "groupName": WORKER_GROUP,
                "replicas": spec.workers.replicas,
                "minReplicas": low,
                "maxReplicas": high,
                "rayStartParams": {},
                "template": {"metadata": {"labels": labels(name, attempt)}, "spec": worker_pod},
            }],
        },
    }
    if low < high:
        head_pod["volumes"].append(_autoscaler_token_volume())
        ray_job_spec["rayClusterSpec"]["autoscalerOptions"] = {"volumeMounts": [{
            "name": SERVICE_ACCOUNT_TOKEN_VOLUME, "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            "readOnly": True}]}
    if spec.ttl_seconds_after_finished is not None:
        ray_job_spec["ttlSecondsAfterFinished"] = spec.ttl_seconds_after_finished
    runtime_env = runtime_env_yaml(resume_from)
    if runtime_env is not None:
        ray_job_spec["runtimeEnvYAML"] = runtime_env
    return {
        "apiVersion": f"{RAY_GROUP}/{RAY_VERSION}",
        "kind": "RayJob",
        "metadata": owned_metadata(job, ray_job_name(name, attempt), labels(name, attempt)),
        "spec": ray_job_spec,
    }
