"""Fixtures of the k8s tier: one real kube-apiserver + etcd for the session, KubeRay v1.7.0's CRDs,
the Helm chart installed through helm-python-sdk, and the operator run as a subprocess that
authenticates as the chart's ServiceAccount (a TokenRequest token), so RBAC holds it to the chart's
ClusterRole. The tests play KubeRay's part by patching RayJob status themselves.
"""
from __future__ import annotations

import pathlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

HERE = pathlib.Path(__file__).resolve().parent

from kubernetes import client, config
from testkit import kuberay_crds
from testkit.k8s_support import (
    CHART,
    RELEASE,
    RELEASE_NAMESPACE,
    SERVICE_ACCOUNT,
    Cluster,
    OperatorProcess,
    wait_for,
)

from scripts import k8s_envtest

# What the session started, so that it can be stopped as soon as the last k8s test is done rather
# than at the end of a whole `make test` run (an idle operator resyncing every second, an apiserver
# and etcd would otherwise share the 2 cores with the other tiers). Stopping twice is harmless.
_STARTED: list[k8s_envtest.EnvTest | OperatorProcess] = []


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or HERE not in pathlib.Path(str(nextitem.fspath)).resolve().parents:
        for started in reversed(_STARTED):  # the operator before the apiserver
            started.stop()


@pytest.fixture(scope="session")
def envtest() -> Iterator[k8s_envtest.EnvTest]:
    cluster = k8s_envtest.EnvTest().start()
    _STARTED.append(cluster)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def admin(envtest: k8s_envtest.EnvTest) -> client.ApiClient:
    """A client with the static admin token (system:masters): the test's own hands."""
    return config.new_client_from_config(config_file=str(envtest.admin_kubeconfig))


@pytest.fixture(scope="session")
def kuberay(admin: client.ApiClient) -> None:
    """KubeRay v1.7.0's RayJob and RayCluster CRDs, adapted for a 1.20 apiserver."""
    kuberay_crds.install(admin)


@pytest.fixture(scope="session")
def release(envtest: k8s_envtest.EnvTest, admin: client.ApiClient, kuberay: None) -> dict[str, Any]:
    """The chart installed by helm-python-sdk (CRD, ServiceAccount, RBAC, Deployment)."""
    import helm_python

    with helm_python.Config(kubeconfig_path=str(envtest.admin_kubeconfig),
                            namespace=RELEASE_NAMESPACE) as helm:
        installed = helm.install(helm_python.Chart.load(str(CHART)), RELEASE,
                                 {"resyncSeconds": 5}, namespace=RELEASE_NAMESPACE, create_namespace=True,
                                 timeout=60)
    extensions = client.ApiextensionsV1Api(admin)
    wait_for(lambda: kuberay_crds.established(extensions, "rayzerojobs.rayzero.io"), 30, "RayZeroJob CRD")
    return installed


@pytest.fixture(scope="session")
def operator_kubeconfig(envtest: k8s_envtest.EnvTest, release: dict[str, Any]) -> pathlib.Path:
    token = envtest.service_account_token(RELEASE_NAMESPACE, SERVICE_ACCOUNT)
    return envtest.write_kubeconfig(token, f"system:serviceaccount:{RELEASE_NAMESPACE}:{SERVICE_ACCOUNT}")


@pytest.fixture(scope="session")
def operator_process(operator_kubeconfig: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[OperatorProcess]:
    process = OperatorProcess(operator_kubeconfig, tmp_path_factory.mktemp("operator"))
    _STARTED.append(process)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def operator(operator_process: OperatorProcess) -> Iterator[OperatorProcess]:
    """The operator, running (restarted if an earlier test stopped it)."""
    if not operator_process.running():
        operator_process.start()
    yield operator_process
    print(f"--- operator log (tail) ---\n{operator_process.log()[-6000:]}")  # shown when a test fails


@pytest.fixture
def cluster(admin: client.ApiClient, release: dict[str, Any]) -> Cluster:
    """A fresh namespace per test (no namespace controller runs here, so it is never deleted)."""
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(admin).create_namespace({"metadata": {"name": namespace}})
    return Cluster(admin, namespace)
