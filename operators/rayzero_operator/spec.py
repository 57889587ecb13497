"""Parse a RayZeroJob spec and find every problem the apiserver's schema could not.

The schema already refused wrong types, ranges, enums and missing fields. What is left for the
operator: keys the apiserver keeps but does not know ([Note: unknown keys in a RayZeroJob]), rules
across fields (`minReplicas <= replicas <= maxReplicas`, exactly one config source) and the DeepSpeed
config's own rules, checked by the same `load_config` as `rayzero config validate`. Each problem names
its field as a path from `spec`, the value, and the fix, so the InvalidSpec condition and Event say
what to change.
"""
from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from rayzero.config import ConfigError, load_config
from rayzero.config.environment import OPERATOR_ALLOWED_HOST_PATHS
from rayzero.config.errors import nearest
from rayzero.config.k8s_job import CONFIG_MOUNT_DIR, GROUP, RayZeroJobSpec
from rayzero.config.runnable import check_runnable
from rayzero_operator import manifests

# [Note: what a RayZeroJob author can bring into a pod]
# People who may create RayZeroJobs but not pods must not get, through the operator, what a pod
# would give them: the operator refuses (InvalidSpec, naming the field) a `storage.nodeLocal.hostPath`
# outside the operator's allowedHostPaths (Helm value; default the node-local root of
# workers/README.md; matched per path component, as PodSecurityPolicy's allowedHostPaths did), and
# a `storage.credentialsSecret` that its owner did not mark for RayZeroJobs with the label
# `rayzero.io/credentials=true` or that is not an Opaque Secret (never a ServiceAccount token, never
# the operator's own per-job Secrets). Nothing else in a spec names a host path or a Secret; the
# pods run without the namespace's ServiceAccount token (manifests.py).
DEFAULT_ALLOWED_HOST_PATHS = ("/mnt/nvme/rayzero",)
CREDENTIALS_LABEL = f"{GROUP}/credentials"
RESERVED_MOUNT_PATHS = (CONFIG_MOUNT_DIR, manifests.CONTROL_TLS_DIR, manifests.SCRATCH_DIR)
"""Where the operator mounts its own volumes in the Ray containers."""


@dataclass(frozen=True)
class SpecProblem:
    """One reason a RayZeroJob cannot be run as written."""

    field: str
    """Path of the field, e.g. `spec.workers.minReplicas`."""
    message: str
    """What is wrong, with the value."""
    fix: str
    """What to change."""

    def __str__(self) -> str:
        return f"{self.field}: {self.message}. Fix: {self.fix}"


def _loc_path(loc: tuple[Any, ...]) -> str:
    parts = ["spec"]
    for item in loc:
        if isinstance(item, int):
            parts[-1] += f"[{item}]"
        else:
            parts.append(str(item))
    return ".".join(parts)


def _fields_of(model: type, loc: tuple[Any, ...]) -> list[str]:
    """The camelCase keys valid at `loc` (for a did-you-mean)."""
    current: Any = model
    for item in loc:
        fields = getattr(current, "model_fields", None)
        if not fields:
            return []
        match = next((info for name, info in fields.items() if item in (name, info.alias)), None)
        if match is None:
            return []
        annotation = match.annotation
        current = next((arg for arg in getattr(annotation, "__args__", ()) if hasattr(arg, "model_fields")),
                       annotation)
    return [info.alias or name for name, info in getattr(current, "model_fields", {}).items()]


def _pydantic_problems(error: ValidationError) -> list[SpecProblem]:
    problems = []
    for item in error.errors():
        loc = tuple(item["loc"])
        path = _loc_path(loc)
        if item["type"] == "extra_forbidden":
            valid = _fields_of(RayZeroJobSpec, loc[:-1])
            guess = nearest(str(loc[-1]), valid)
            fix = f"did you mean `{guess}`?" if guess else "remove it; valid keys here: " + ", ".join(valid)
            problems.append(SpecProblem(path, "unknown field (the apiserver keeps it but nothing reads it)",
                                        fix))
        else:
            problems.append(SpecProblem(path, f"{item['msg']} (got {item.get('input')!r})",
                                        "see `kubectl explain rayzerojob.spec` for the allowed values"))
    return problems


def _cross_field_problems(spec: RayZeroJobSpec) -> list[SpecProblem]:
    problems = []
    workers = spec.workers
    low, high = spec.world_bounds()
    if low > workers.replicas:
        problems.append(SpecProblem(
            "spec.workers.minReplicas", f"{low} is more than replicas ({workers.replicas})",
            f"set minReplicas <= {workers.replicas} or raise replicas"))
    if high < workers.replicas:
        problems.append(SpecProblem(
            "spec.workers.maxReplicas", f"{high} is less than replicas ({workers.replicas})",
            f"set maxReplicas >= {workers.replicas} or lower replicas"))
    source = spec.deepspeed
    if (source.config is None) == (source.config_map_ref is None):
        problems.append(SpecProblem(
            "spec.deepspeed", "needs exactly one of `config` (inline) and `configMapRef`"
            + (" but both are set" if source.config is not None else " but neither is set"),
            "keep one of spec.deepspeed.config and spec.deepspeed.configMapRef"))
    local = spec.storage.node_local
    if local is not None and (local.host_path is None) == (local.storage_class_name is None):
        problems.append(SpecProblem(
            "spec.storage.nodeLocal", "needs exactly one of `hostPath` and `storageClassName`",
            "keep one of spec.storage.nodeLocal.hostPath and spec.storage.nodeLocal.storageClassName"))
    return problems


def _is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def parse_allowed_host_paths(text: str | None) -> tuple[str, ...]:
    """The operator's allowedHostPaths from its environment (a JSON list; unset: the default)."""
    if text is None:
        return DEFAULT_ALLOWED_HOST_PATHS
    try:
        roots = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{OPERATOR_ALLOWED_HOST_PATHS.name}={text!r} is not JSON ({error}); set a JSON list of "
                         "absolute directories, e.g. [\"/mnt/nvme/rayzero\"] (Helm value allowedHostPaths)") from None
    bad = [root for root in roots if not isinstance(root, str) or not root.startswith("/")
           or posixpath.normpath(root) != root or root == "/"] if isinstance(roots, list) else [roots]
    if bad:
        raise ValueError(f"{OPERATOR_ALLOWED_HOST_PATHS.name}: {bad!r} are not normalized absolute directories other than "
                         "/; set a JSON list such as [\"/mnt/nvme/rayzero\"] (Helm value allowedHostPaths)")
    return tuple(roots)


def storage_problems(spec: RayZeroJobSpec, allowed_host_paths: tuple[str, ...]) -> list[SpecProblem]:
    """The node-local volume's paths ([Note: what a RayZeroJob author can bring into a pod])."""
    local = spec.storage.node_local
    if local is None:
        return []
    problems = []
    if local.host_path is not None and not any(_is_within(local.host_path, root) for root in allowed_host_paths):
        allowed = ", ".join(allowed_host_paths) or "none: hostPath volumes are turned off"
        problems.append(SpecProblem(
            "spec.storage.nodeLocal.hostPath", f"{local.host_path!r} is outside the directories this operator "
            f"lets RayZeroJobs mount from the node ({allowed})",
            "use a directory under one of them, or storageClassName for a local volume; a cluster admin "
            "widens the list with the Helm value allowedHostPaths"))
    clashes = [reserved for reserved in RESERVED_MOUNT_PATHS
               if _is_within(local.mount_path, reserved) or _is_within(reserved, local.mount_path)]
    if clashes:
        problems.append(SpecProblem(
            "spec.storage.nodeLocal.mountPath", f"{local.mount_path!r} overlaps {', '.join(clashes)}, where "
            "the operator mounts its own volumes", "use another directory, e.g. /mnt/rayzero-local"))
    return problems


def credentials_problems(spec: RayZeroJobSpec, secret: dict[str, Any] | None, namespace: str
                         ) -> list[SpecProblem]:
    """`storage.credentialsSecret` against the Secret found (`{"type": ..., "labels": {...}}`, None
    when there is none): see [Note: what a RayZeroJob author can bring into a pod]."""
    name = spec.storage.credentials_secret
    if name is None:
        return []
    field = "spec.storage.credentialsSecret"
    label = f"`kubectl label secret -n {namespace} {name} {CREDENTIALS_LABEL}=true`"
    if secret is None:
        return [SpecProblem(field, f"Secret {name!r} was not found in namespace {namespace!r}",
                            f"create it, then mark it for RayZeroJobs: {label}")]
    labels = secret.get("labels") or {}
    if labels.get("app.kubernetes.io/managed-by") == manifests.MANAGED_BY:
        return [SpecProblem(field, f"Secret {name!r} is one the rayzero operator made for a job",
                            "name a Secret holding your storage credentials")]
    if (secret.get("type") or "Opaque") != "Opaque":
        return [SpecProblem(field, f"Secret {name!r} has type {secret.get('type')!r}; only Opaque Secrets can "
                            "hold storage credentials", "put the credentials in an Opaque Secret")]
    if labels.get(CREDENTIALS_LABEL) != "true":
        return [SpecProblem(field, f"Secret {name!r} is not marked for RayZeroJobs (label {CREDENTIALS_LABEL}="
                            "true): a RayZeroJob may only bring Secrets whose owner allowed it",
                            f"someone who may manage Secrets in {namespace!r} runs {label}")]
    return []


def deepspeed_problems(config: Any, world_size: int, where: str) -> list[SpecProblem]:
    """Problems of one DeepSpeed config (a dict, or JSON text from a ConfigMap) at `where`."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as error:
            return [SpecProblem(where, f"is not valid JSON ({error})", "store the DeepSpeed config as JSON")]
    if not isinstance(config, dict):
        return [SpecProblem(where, f"must be a JSON object, got {type(config).__name__}",
                            "store the DeepSpeed config as a JSON object")]
    try:
        # valid for DeepSpeed and runnable by this build, before any RayJob or pod exists
        check_runnable(load_config(config, world_size=world_size, allow_unresolved=True), where)
    except ConfigError as error:
        return [SpecProblem(f"{where}.{problem.path}" if problem.path else where,
                            f"{problem.value!r}: {problem.rule}", problem.fix or "see docs/config.md")
                for problem in error.problems]
    return []


def parse_spec(raw: dict[str, Any]) -> tuple[RayZeroJobSpec | None, list[SpecProblem]]:
    """The parsed spec (None when it does not parse) and every problem found without the cluster.

    A referenced ConfigMap is checked separately (`deepspeed_problems`) once it has been read.
    """
    try:
        spec = RayZeroJobSpec.model_validate(raw)
    except ValidationError as error:
        return None, _pydantic_problems(error)
    problems = _cross_field_problems(spec)
    if spec.deepspeed.config is not None:
        problems += deepspeed_problems(spec.deepspeed.config, spec.world_size(), "spec.deepspeed.config")
    return spec, problems
