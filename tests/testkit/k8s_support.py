"""Helpers of the k8s tests (a module of its own, so no test imports `conftest` by name: other
test directories have conftest modules too). Fixtures live in tests/k8s/conftest.py."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import yaml
from kubernetes import client
from rayzero_operator.kube import or_none

from scripts import k8s_envtest

REPO = pathlib.Path(__file__).resolve().parents[2]

CHART = REPO / "helm" / "rayzero-operator"
RELEASE = "rzo"  # deploy/rbac.yaml is rendered with the same release name
RELEASE_NAMESPACE = "rayzero-system"
SERVICE_ACCOUNT = "rzo-rayzero-operator"
RESYNC_SECONDS = 1.0


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0, what: str = "condition",
             interval: float = 0.1) -> Any:
    """Poll until `predicate()` is truthy; its value is returned. Fails with `what` on timeout. The
    default bound covers an operator pass on a loaded machine (20 s was missed in a fresh clone's
    `make test`); a condition that holds sooner returns sooner."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


class OperatorProcess:
    """`python -m rayzero_operator` as a subprocess with the ServiceAccount's kubeconfig."""

    def __init__(self, kubeconfig: pathlib.Path, log_dir: pathlib.Path) -> None:
        self.kubeconfig = kubeconfig
        self.log_dir = log_dir
        self.process: subprocess.Popen | None = None
        self.runs = 0

    def start(self, *namespaces: str, **extra_env: str) -> OperatorProcess:
        """Start it watching `namespaces` (default: all) with `extra_env` added."""
        assert self.process is None or self.process.poll() is not None, "operator already running"
        self.runs += 1
        # a port bound only once kopf has started: below the ephemeral range ([Note: ports below the
        # ephemeral range] in rayzero/ports.py), where no outgoing connection takes it meanwhile
        port = k8s_envtest.server_port()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig),
               "RAYZERO_OPERATOR_RESYNC_S": str(RESYNC_SECONDS), **extra_env}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self.log_path = self.log_dir / f"operator-{self.runs}.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rayzero_operator", "--verbose",
             f"--liveness=http://127.0.0.1:{port}/healthz", *(f"--namespace={ns}" for ns in namespaces)],
            env=env, stdout=open(self.log_path, "wb"),  # noqa: SIM115 (the child keeps it)
            stderr=subprocess.STDOUT, cwd=str(REPO), start_new_session=True)
        import urllib.request

        import psutil

        def healthy() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"operator exited with {self.process.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as answer:
                    answered = answer.status == 200
            except OSError:
                return False
            # and the listener is this operator's (one that failed to bind exits a moment later, and
            # another server on the port must not pass for it)
            listening = {conn.laddr.port for conn in psutil.Process(self.process.pid).net_connections("tcp")
                         if conn.status == psutil.CONN_LISTEN}
            return answered and port in listening

        wait_for(healthy, 30, "the operator's liveness endpoint", interval=0.2)
        return self

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when a node dies under the operator."""
        if self.running():
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.running():
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.process is not None else ""

    def all_logs(self) -> str:
        return "\n".join(path.read_text(errors="replace") for path in sorted(self.log_dir.glob("operator-*.log")))


class Cluster:
    """The test's view of one namespace: RayZeroJobs, RayJobs, ConfigMaps, Events (admin client)."""

    def __init__(self, admin: client.ApiClient, namespace: str) -> None:
        self.namespace = namespace
        self.custom = client.CustomObjectsApi(admin)
        self.core = client.CoreV1Api(admin)

    def create_job(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        body = {"apiVersion": "rayzero.io/v1alpha1", "kind": "RayZeroJob",
                "metadata": {"name": name, "namespace": self.namespace}, "spec": spec}
        return self.custom.create_namespaced_custom_object("rayzero.io", "v1alpha1", self.namespace,
                                                           "rayzerojobs", body)

    def job(self, name: str) -> dict[str, Any] | None:
        return or_none(self.custom.get_namespaced_custom_object, "rayzero.io", "v1alpha1", self.namespace,
                        "rayzerojobs", name)

    def patch_job(self, name: str, patch: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object("rayzero.io", "v1alpha1", self.namespace, "rayzerojobs",
                                                   name, patch)

    def delete_job(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object("rayzero.io", "v1alpha1", self.namespace, "rayzerojobs",
                                                    name)

    def status(self, name: str) -> dict[str, Any]:
        return (self.job(name) or {}).get("status") or {}

    def phase_is(self, name: str, phase: str) -> Callable[[], Any]:
        return lambda: self.status(name) if self.status(name).get("phase") == phase else None

    def ray_jobs(self, job_name: str) -> list[dict[str, Any]]:
        found = self.custom.list_namespaced_custom_object(
            "ray.io", "v1", self.namespace, "rayjobs", label_selector=f"rayzero.io/job={job_name}")
        return sorted(found["items"], key=lambda item: item["metadata"]["name"])

    def ray_job(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object("ray.io", "v1", self.namespace, "rayjobs", name)

    def set_ray_job_status(self, name: str, **status: Any) -> None:
        """Play KubeRay: write the RayJob's status through its status subresource."""
        self.custom.patch_namespaced_custom_object_status("ray.io", "v1", self.namespace, "rayjobs", name,
                                                          {"status": status})

    def config_map(self, name: str) -> client.V1ConfigMap | None:
        return or_none(self.core.read_namespaced_config_map, name, self.namespace)

    def secret(self, name: str) -> client.V1Secret | None:
        return or_none(self.core.read_namespaced_secret, name, self.namespace)

    def events(self, name: str) -> list[client.CoreV1Event]:
        found = self.core.list_namespaced_event(self.namespace,
                                                field_selector=f"involvedObject.name={name}")
        return list(found.items)

    def event(self, name: str, reason: str, timeout: float = 20.0) -> list[client.CoreV1Event]:
        """The events of `reason` on `name`, waited for: the operator posts a pass's events after its
        status patch, so a test that has just seen the status may list the events a moment early."""
        return wait_for(lambda: [event for event in self.events(name) if event.reason == reason], timeout,
                        f"a {reason} event on {name}")

    def reconciled_again(self, name: str, passes: int = 2, timeout: float = 30.0) -> dict[str, Any]:
        """Return once the operator has reconciled `name` `passes` more times, each seeing the job as
        it is now; the job's status then. What proves "nothing more happens" without sleeping on the
        resync interval: each pass is started by a spec edit no decision reads (an extra entrypoint
        argument, used only when a RayJob is made), which bumps metadata.generation; the operator
        writes status.observedGeneration after every RayJob, Secret and ConfigMap it decided to
        create in that pass, so whatever it would do to the job is done when the status shows it."""
        for _ in range(passes):
            args = (self.job(name) or {})["spec"]["entrypoint"].get("args", [])
            self.patch_job(name, {"spec": {"entrypoint": {"args": [*args, f"--pass-{len(args)}"]}}})
            generation = self.job(name)["metadata"]["generation"]
            status = wait_for(lambda seen=generation: (s := self.status(name)).get("observedGeneration") == seen and s,
                              timeout, f"the operator to reconcile {name} at generation {generation}")
        return status

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        for condition in self.status(name).get("conditions", []):
            if condition["type"] == kind:
                return condition
        return {}


def head_tls_files(secret: client.V1Secret, directory: pathlib.Path) -> Any:
    """The control TLS files the head pod's Secret volume holds, written to `directory`, as the
    control service's TlsFiles (it serves with them as it does in the pod)."""
    import base64

    from rayzero.controller.control_server import TlsFiles

    directory.mkdir()
    for key in ("ca.crt", "tls.crt", "tls.key"):
        (directory / key).write_bytes(base64.b64decode(secret.data[key]))
    return TlsFiles(str(directory / "tls.crt"), str(directory / "tls.key"), str(directory / "ca.crt"))


def labelled_credentials(cluster: Cluster, name: str, *, label: bool = True, **extra: Any) -> None:
    """A storage credentials Secret in the cluster's namespace, marked for RayZeroJobs unless `label`
    is False ([Note: what a RayZeroJob author can bring into a pod])."""
    labels = {"rayzero.io/credentials": "true"} if label else {}
    cluster.core.create_namespaced_secret(cluster.namespace, {
        "metadata": {"name": name, "labels": labels}, "stringData": {"AWS_ACCESS_KEY_ID": "AKIA-TEST"}, **extra})


def example(name: str) -> dict[str, Any]:
    """The spec of an example from deploy/examples (the tests run the examples users read)."""
    return yaml.safe_load((REPO / "deploy" / "examples" / f"{name}.yaml").read_text())["spec"]
