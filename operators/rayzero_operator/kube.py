"""The only module of our own that talks to the Kubernetes API (kopf does its own watching).

Every call here is one the Helm chart's rules grant, and nothing more: when you add a call, add its
verb to `rayzero-operator.rules` in helm/rayzero-operator/templates/_helpers.tpl (the ClusterRole and
the namespaced Roles both use it; the k8s tests run the operator with exactly those, so a missing
verb fails them).
"""
from __future__ import annotations

import base64
import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from rayzero.config.k8s_job import GROUP, KIND, PLURAL, VERSION
from rayzero_operator import manifests

logger = logging.getLogger(__name__)


def load_client() -> client.ApiClient:
    """In a pod: the ServiceAccount token; elsewhere: $KUBECONFIG or ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def or_none(read: Callable[..., Any], *args: Any) -> Any:
    """What `read(*args)` returns, or None where the object does not exist (404)."""
    try:
        return read(*args)
    except ApiException as error:
        if error.status == 404:
            return None
        raise


class KubeApi:
    """Reads and writes RayZeroJobs, their RayJobs, ConfigMaps and Events."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.custom = client.CustomObjectsApi(api_client)  # RayZeroJobs and RayJobs
        self.core = client.CoreV1Api(api_client)  # ConfigMaps and Events

    # --- reads ------------------------------------------------------------------------------------

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return or_none(self.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name)

    def list_ray_jobs(self, namespace: str, job_name: str) -> list[dict[str, Any]]:
        found = self.custom.list_namespaced_custom_object(
            manifests.RAY_GROUP, manifests.RAY_VERSION, namespace, manifests.RAY_PLURAL,
            label_selector=f"{manifests.LABEL_JOB}={job_name}")
        return list(found.get("items", []))

    def control_credentials(self, namespace: str, job_name: str) -> tuple[str | None, str | None]:
        """(token, CA certificate PEM) of the job's control service from its Secret ([Note: the job's
        tokens]); None for what is absent."""
        secret = or_none(self.core.read_namespaced_secret, manifests.auth_secret_name(job_name), namespace)
        data = (secret.data if secret is not None else None) or {}
        token, ca = (data.get(key) for key in (manifests.CONTROL_TOKEN_KEY, manifests.CA_KEY))
        return (base64.b64decode(token).decode() if token else None, base64.b64decode(ca).decode() if ca else None)

    def secret_facts(self, namespace: str, name: str) -> dict[str, Any] | None:
        """Type and labels of a Secret (what spec.storage.credentialsSecret is checked against); None
        when there is none. Its data is not kept."""
        secret = or_none(self.core.read_namespaced_secret, name, namespace)
        return None if secret is None else {"type": secret.type, "labels": dict(secret.metadata.labels or {})}

    def config_map_labels(self, namespace: str, name: str) -> dict[str, str] | None:
        """Labels of a ConfigMap, or None when there is none of that name."""
        config_map = or_none(self.core.read_namespaced_config_map, name, namespace)
        return None if config_map is None else dict(config_map.metadata.labels or {})

    def read_config_text(self, namespace: str, name: str, key: str) -> str | None:
        config_map = or_none(self.core.read_namespaced_config_map, name, namespace)
        return None if config_map is None else (config_map.data or {}).get(key)

    # --- writes -----------------------------------------------------------------------------------

    def create(self, manifest: dict[str, Any]) -> bool:
        """Create a Secret, ConfigMap or RayJob; False when it already exists (another reconcile made it).
        An existing Secret keeps Ray's token; its control credentials are replaced when the manifest is
        for a newer attempt than theirs, once ([Note: the job's tokens]).

        An existing ConfigMap is brought up to date (its content follows the spec for the next
        attempt); an existing RayJob is left alone (one RayJob per attempt, never rewritten).
        """
        meta = manifest["metadata"]
        try:
            if manifest["kind"] == "Secret":
                self.core.create_namespaced_secret(meta["namespace"], manifest)
            elif manifest["kind"] == "ConfigMap":
                self.core.create_namespaced_config_map(meta["namespace"], manifest)
            else:
                self.custom.create_namespaced_custom_object(
                    manifests.RAY_GROUP, manifests.RAY_VERSION, meta["namespace"], manifests.RAY_PLURAL,
                    manifest)
            return True
        except ApiException as error:
            if error.status != 409:
                raise
        if manifest["kind"] == "ConfigMap":
            self.core.patch_namespaced_config_map(meta["name"], meta["namespace"], {"data": manifest["data"]})
        elif manifest["kind"] == "Secret":
            self._rotate_control_credentials(manifest)
        return False

    def _rotate_control_credentials(self, manifest: dict[str, Any]) -> None:
        meta = manifest["metadata"]
        existing = self.core.read_namespaced_secret(meta["name"], meta["namespace"])
        key = manifests.CONTROL_ATTEMPT_ANNOTATION
        had = int((existing.metadata.annotations or {}).get(key) or 0)
        if had >= int(meta["annotations"][key]):
            return  # this attempt's credentials are there already (a repeated reconcile)
        fresh = {name: value for name, value in manifest["data"].items() if name != manifests.RAY_TOKEN_KEY}
        # resourceVersion: of two racing reconciles only one replaces them; the other gets a 409.
        self.core.patch_namespaced_secret(meta["name"], meta["namespace"], {
            "metadata": {"annotations": {key: meta["annotations"][key]},
                         "resourceVersion": existing.metadata.resource_version},
            "data": fresh})

    def patch_ray_job(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            manifests.RAY_GROUP, manifests.RAY_VERSION, namespace, manifests.RAY_PLURAL, name, patch)

    def patch_job_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status})

    def post_event(self, job: dict[str, Any], kind: str, reason: str, message: str) -> None:
        meta = job["metadata"]
        now = dt.datetime.now(dt.timezone.utc)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{meta['name']}.", namespace=meta["namespace"]),
            involved_object=client.V1ObjectReference(
                api_version=f"{GROUP}/{VERSION}", kind=KIND, name=meta["name"],
                namespace=meta["namespace"], uid=meta.get("uid")),
            reason=reason, message=message[:1024], type=kind, count=1,
            first_timestamp=now, last_timestamp=now,
            source=client.V1EventSource(component=manifests.MANAGED_BY),
            reporting_component=manifests.MANAGED_BY)
        try:
            self.core.create_namespaced_event(meta["namespace"], event)
        except ApiException as error:  # an Event is a courtesy: never fail a reconcile over one
            logger.warning("could not post event %s on %s: %s", reason, meta["name"], error.reason)

    def delete_owned(self, namespace: str, job_name: str) -> list[str]:
        """Delete the job's RayJobs, control Secret and generated ConfigMap; returns what was deleted.

        The garbage collector would do it through the owner references too; doing it in the
        finalizer stops the Ray clusters at once, even where garbage collection is slow or absent.
        """
        deleted = []

        def delete(label: str, call: Any, *args: Any, **kwargs: Any) -> None:
            try:
                call(*args, **kwargs)
                deleted.append(label)
            except ApiException as error:
                if error.status != 404:  # already gone
                    raise

        for ray_job in self.list_ray_jobs(namespace, job_name):
            name = ray_job["metadata"]["name"]
            delete(f"RayJob/{name}", self.custom.delete_namespaced_custom_object, manifests.RAY_GROUP,
                   manifests.RAY_VERSION, namespace, manifests.RAY_PLURAL, name,
                   propagation_policy="Background")
        secret, config_map = manifests.auth_secret_name(job_name), manifests.config_map_name(job_name)
        delete(f"Secret/{secret}", self.core.delete_namespaced_secret, secret, namespace)
        delete(f"ConfigMap/{config_map}", self.core.delete_namespaced_config_map, config_map, namespace)
        return deleted
