"""KubeRay v1.7.0's own RayJob and RayCluster CRDs (/work/shared/kuberay-crds, copied into
tests/k8s/data), adapted for the Kubernetes 1.20 apiserver with three mechanical edits so it
validates every RayJob the operator writes against KubeRay's real schema:

1. drop every `x-kubernetes-validations` (CEL rules; 1.20 predates them),
2. drop every `default: ""` (1.20 refuses them where the schema nests them),
3. drop `x-kubernetes-list-type: map` with its `x-kubernetes-list-map-keys` (lists become atomic).

One more edit for speed only: `description`s are dropped (they are most of the 2.3 MB and never
take part in validation); the apiserver then takes a few seconds instead of ~25 s to install them.
"""
from __future__ import annotations

import pathlib
import time
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

DATA = pathlib.Path(__file__).resolve().parents[1] / "k8s" / "data"
FILES = ("ray.io_rayjobs.yaml", "ray.io_rayclusters.yaml")


def adapt(node: Any) -> Any:
    if isinstance(node, list):
        return [adapt(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "x-kubernetes-validations":
            continue
        if key == "default" and value == "":
            continue
        if key == "x-kubernetes-list-type" and value == "map":
            continue
        if key == "x-kubernetes-list-map-keys":
            continue
        if key == "description" and isinstance(value, str):
            continue
        out[key] = adapt(value)
    return out


def established(extensions: client.ApiextensionsV1Api, name: str) -> bool:
    try:
        crd = extensions.read_custom_resource_definition(name)
    except ApiException as error:
        if error.status == 404:
            return False
        raise
    return any(condition.type == "Established" and condition.status == "True"
               for condition in (crd.status.conditions or []))


def install(admin: client.ApiClient) -> None:
    extensions = client.ApiextensionsV1Api(admin)
    for file_name in FILES:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: 10x faster on 2.3 MB
        crd = adapt(yaml.load((DATA / file_name).read_text(), Loader=loader))
        crd.get("metadata", {}).pop("annotations", None)
        crd.pop("status", None)
        # A plain dict goes out as is (the typed models would drop the x-kubernetes-* keys).
        try:
            extensions.create_custom_resource_definition(crd)
        except ApiException as error:
            if error.status != 409:
                raise
    # a wait on the condition: a loaded apiserver took over 30 s to establish these 2.3 MB CRDs (make test)
    deadline = time.monotonic() + 120
    for name in ("rayjobs.ray.io", "rayclusters.ray.io"):
        while not established(extensions, name):
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {name} not established")
            time.sleep(0.1)
