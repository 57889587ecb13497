"""The RayZeroJob custom resource: spec and status, defined once.

These models are the single source of the `RayZeroJob` CRD: `rayzero_operator.crd` turns their JSON
schema into the CRD's OpenAPI v3 schema (so the apiserver refuses wrong types, ranges, enums and
missing fields), and the operator parses every object with them (so what a schema cannot say —
`minReplicas <= replicas <= maxReplicas`, unknown keys, the DeepSpeed config's own rules — is
refused with the same field names). Field names are the camelCase ones users write in YAML.

This module imports neither torch nor ray: the operator imports only `rayzero.config`.

[Note: unknown keys in a RayZeroJob]
A Kubernetes 1.20 apiserver has no strict field validation: a structural schema *prunes* unknown
fields silently, so `maxRestart: 5` would vanish and the user would get the default. Every object in
the generated schema is therefore marked `x-kubernetes-preserve-unknown-fields`, and these models
forbid extra keys, so the operator reports the typo (with the nearest valid key) as InvalidSpec.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

GROUP = "rayzero.io"
VERSION = "v1alpha1"
KIND = "RayZeroJob"
PLURAL = "rayzerojobs"
SINGULAR = "rayzerojob"
SHORT_NAMES = ["rzj"]

CONFIG_MOUNT_DIR = "/etc/rayzero"
"""Where the generated ConfigMap is mounted in every Ray pod."""
GPU_RESOURCE = "nvidia.com/gpu"
CONFIG_FILE_NAME = "ds_config.json"
"""The key of the DeepSpeed config in the generated ConfigMap; `rayzero run --config` reads it."""

# The Kubernetes resource.Quantity grammar (as in the core OpenAPI spec): "2", "500m", "16Gi", "1e3".
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# An absolute, normalized path other than "/": no empty, "." or ".." component (RE2: no lookarounds).
NORMALIZED_PATH_PATTERN = r"^(/([^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+))+$"
# DNS-1123 subdomain: what Kubernetes accepts for ConfigMap and Secret names.
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, bool):
        # ValueError, not TypeError: pydantic turns only ValueError into a validation message.
        raise ValueError("expected a quantity such as 2, \"500m\" or \"16Gi\", got a boolean")  # noqa: TRY004
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a resource quantity cannot be negative, got {value}")
        return value
    if not re.match(QUANTITY_PATTERN, value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity; write e.g. 2, \"500m\" or \"16Gi\"")
    return value


Quantity = Annotated[
    int | str,
    AfterValidator(_check_quantity),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}),
]
"""A Kubernetes resource quantity: an integer or a string like "500m" / "16Gi"."""

FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
"""A JSON object the apiserver stores as is; its rules are checked by the operator."""


class K8sModel(BaseModel):
    """camelCase keys as users write them in YAML; unknown keys refused (see the note above)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", use_attribute_docstrings=True
    )


class Entrypoint(K8sModel):
    """What `rayzero run` executes in the RayJob."""

    target: str = Field(min_length=1)
    """The training loop: `path/to/train.py:function` or `package.module:function`."""
    args: list[str] = Field(default_factory=list)
    """Arguments passed to the training loop after `--`."""


class ConfigMapKeyRef(K8sModel):
    """A DeepSpeed JSON config kept in an existing ConfigMap of the job's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """The ConfigMap's name."""
    key: str = Field(default=CONFIG_FILE_NAME, min_length=1)
    """The key holding the JSON text."""


class DeepSpeedSource(K8sModel):
    """The DeepSpeed config: inline or a ConfigMap reference (exactly one)."""

    config: FreeForm | None = None
    """The DeepSpeed JSON config inline, as an object. Validated by the operator with the same models
    as `rayzero config validate`."""
    config_map_ref: ConfigMapKeyRef | None = None
    """A ConfigMap holding the DeepSpeed JSON config."""


class Resources(K8sModel):
    """Container resources, as in a Pod spec (`cpu`, `memory`, `nvidia.com/gpu`, ...)."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    """Minimum resources the scheduler reserves."""
    limits: dict[str, Quantity] = Field(default_factory=dict)
    """Maximum resources; GPUs (`nvidia.com/gpu`) must be set here."""


class Workers(K8sModel):
    """The Ray worker group: one training worker per pod."""

    replicas: int = Field(ge=1, le=10000)
    """Worker pods to start with. Each runs one training rank per GPU (one rank when CPU-only), so
    the world size is replicas × GPUs per pod."""
    min_replicas: int | None = Field(default=None, ge=1, le=10000)
    """Fewest workers training may continue with (elastic); defaults to `replicas`."""
    max_replicas: int | None = Field(default=None, ge=1, le=10000)
    """Most workers training may grow to (elastic); defaults to `replicas`."""
    resources: Resources = Field(default_factory=Resources)
    """Resources of each worker pod."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels worker pods must match (e.g. a GPU node pool)."""
    termination_grace_period_seconds: int = Field(default=120, ge=0, le=86400)
    """Seconds a worker pod gets between SIGTERM (preemption, drain, scale-down) and SIGKILL: long
    enough for the planned stop to commit a checkpoint of the current step."""


class Head(K8sModel):
    """The Ray head pod (runs the driver and the rayzero controller, no training)."""

    resources: Resources = Field(default_factory=Resources)
    """Resources of the head pod."""
    control_port: int = Field(default=50051, ge=1024, le=65535)
    """Port of the run's control service (gRPC `rayzero.v1.Control`) on the head pod; the operator
    reads the run's step, loss and checkpoints through it and asks for checkpoints, stops and scaling."""


class NodeLocal(K8sModel):
    """Fast node-local disk for the first checkpoint tier and NVMe offload: a hostPath or a local
    volume (a generic ephemeral volume from a local-storage StorageClass) — exactly one."""

    host_path: str | None = Field(default=None, pattern=NORMALIZED_PATH_PATTERN)
    """A directory on every node, prepared by its administrator (e.g. an NVMe mount as in
    workers/README.md); it must lie under one of the operator's allowedHostPaths."""
    storage_class_name: str | None = Field(default=None, min_length=1)
    """A StorageClass of local PersistentVolumes; each pod gets its own claim of `size`."""
    size: Quantity = "100Gi"
    """The claim size when `storageClassName` is used."""
    mount_path: str = Field(default="/mnt/rayzero-local", pattern=r"^/")
    """Where the volume appears in the pods; exported as RAYZERO_NODE_LOCAL_DIR."""


class Storage(K8sModel):
    """Where checkpoints go: node-local disk first, then durable storage."""

    node_local: NodeLocal | None = None
    """Node-local volume; without it pods use an emptyDir (lost with the pod)."""
    durable_uri: str | None = Field(default=None, pattern=r"^[a-z][a-z0-9+.-]*://")
    """Durable storage for checkpoints (`s3://bucket/prefix`, `gs://…`, `file:///shared/…`).
    Needed to resume after a restart: without it a retried attempt starts from step 0."""
    credentials_secret: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """A Secret whose keys become environment variables of every Ray pod (e.g. AWS_ACCESS_KEY_ID)."""


class FailurePolicy(K8sModel):
    """The job's one retry budget (KubeRay's own backoffLimit stays 0)."""

    max_restarts: int = Field(default=3, ge=0, le=1000)
    """How many fresh RayJobs may be started after failures, each resuming from the newest durable
    checkpoint. 0 means a failure is final."""
    backoff_seconds: int = Field(default=30, ge=0, le=86400)
    """Wait between a failure and the next attempt."""


class RayZeroJobSpec(K8sModel):
    """A training run: what to run, with which DeepSpeed config, on how many workers."""

    image: str = Field(min_length=1)
    """Container image of the Ray pods; must have rayzero installed (see workers/Dockerfile)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """When the kubelet pulls `image`."""
    entrypoint: Entrypoint
    """What `rayzero run` executes."""
    deepspeed: DeepSpeedSource
    """The DeepSpeed config."""
    workers: Workers
    """The worker group."""
    head: Head = Field(default_factory=Head)
    """The Ray head pod."""
    storage: Storage = Field(default_factory=Storage)
    """Checkpoint storage."""
    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy)
    """Restarts and backoff."""
    suspend: bool = False
    """true stops the run (its Ray cluster is deleted by KubeRay); false resumes it."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    """Delete the finished Ray cluster this long after the run ends (KubeRay's TTL)."""
    ray_version: str = Field(default="2.60.0", pattern=r"^[0-9]+\.[0-9]+\.[0-9]+$")
    """Ray version in `image`, for KubeRay."""

    def gpus_per_worker(self) -> int:
        """GPUs of each worker pod (`nvidia.com/gpu` in limits, else requests); 0 for CPU workers."""
        resources = self.workers.resources
        value = resources.limits.get(GPU_RESOURCE, resources.requests.get(GPU_RESOURCE, 0))
        try:
            return int(value)
        except ValueError:
            return 0  # a fractional or suffixed GPU quantity is not schedulable anyway

    def world_size(self) -> int:
        """Training ranks at the start: one per GPU (one per pod for CPU workers)."""
        return self.workers.replicas * max(self.gpus_per_worker(), 1)

    def world_bounds(self) -> tuple[int, int]:
        """(minReplicas, maxReplicas) with the defaults applied."""
        workers = self.workers
        low = workers.min_replicas if workers.min_replicas is not None else workers.replicas
        high = workers.max_replicas if workers.max_replicas is not None else workers.replicas
        return low, high


Phase = Literal["Pending", "Running", "Restarting", "Succeeded", "Failed", "Suspended"]


class Condition(K8sModel):
    """A Kubernetes-style condition (`kubectl describe` shows them)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", use_attribute_docstrings=True
    )

    type: str
    """Ready, InvalidSpec, Suspended, Restarting, Succeeded or Failed."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str = ""
    """One CamelCase word a program can match on."""
    message: str = ""
    """What happened and what to do, for a human."""
    last_transition_time: str | None = None
    """When `status` last changed (RFC 3339)."""


class RayZeroJobStatus(K8sModel):
    """What the operator observed; written only by the operator through the status subresource."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", use_attribute_docstrings=True
    )

    phase: Phase | None = None
    """Pending, Running, Restarting, Succeeded, Failed or Suspended."""
    restarts: int = Field(default=0, ge=0)
    """Restarts used from `failurePolicy.maxRestarts`."""
    attempt: int = Field(default=0, ge=0)
    """The current attempt (1 for the first RayJob)."""
    ray_job_name: str | None = None
    """The RayJob of the current attempt."""
    workers: int = Field(default=0, ge=0)
    """Workers requested for the current attempt."""
    resume_from: str | None = None
    """The durable checkpoint location the current attempt resumes from, if any."""
    observed_generation: int | None = None
    """The spec generation this status describes."""
    conditions: list[Condition] = Field(default_factory=list)
    """Ready, InvalidSpec, Suspended, Restarting, Succeeded, Failed."""
    run_state: str | None = None
    """The rayzero controller's state (running, restarting, resizing, ...), from the control service."""
    step: int | None = None
    """Newest training step rank 0 reported, from the control service."""
    loss: float | None = None
    """Loss of that report."""
    world_size: int | None = None
    """Training ranks of the current worker group."""
    failures: int | None = None
    """Worker failures the controller restarted from (inside the attempt; `restarts` counts attempts)."""
    goodput: float | None = None
    """Kept training time over the run's wall time (0-1), from the control service."""
    badput_seconds: dict[str, float] | None = None
    """Where the rest of the wall time went, seconds per cause (start-up, restart, failure detection,
    redone steps, checkpoint stall, planned, idle)."""
    last_checkpoint: str | None = None
    """Location of the newest committed checkpoint (durable tier when there is one)."""
    last_checkpoint_step: int | None = None
    """Step of that checkpoint."""
    control_time: str | None = None
    """When the control service last answered (RFC 3339)."""
    checkpoint_request: str | None = None
    """The value of the `rayzero.io/checkpoint-now` annotation last carried out."""
    scale_request: int | None = None
    """The world size last asked of the run through `Scale`."""
