"""Without KubeRay the operator says so on each RayZeroJob, and starts the jobs once KubeRay's CRDs
appear. Its own apiserver: the session's one has KubeRay installed from the start."""
from __future__ import annotations

import pathlib

import helm_python
import pytest
from kubernetes import client, config
from testkit import kuberay_crds
from testkit.k8s_support import CHART, Cluster, OperatorProcess, example, wait_for

from scripts import k8s_envtest


@pytest.fixture
def bare_cluster(tmp_path: pathlib.Path):
    envtest = k8s_envtest.EnvTest().start()
    operator = None
    try:
        with helm_python.Config(kubeconfig_path=str(envtest.admin_kubeconfig), namespace="rzs") as helm:
            helm.install(helm_python.Chart.load(str(CHART)), "rzo", {}, namespace="rzs", create_namespace=True,
                         timeout=60)
        admin = config.new_client_from_config(config_file=str(envtest.admin_kubeconfig))
        wait_for(lambda: kuberay_crds.established(client.ApiextensionsV1Api(admin), "rayzerojobs.rayzero.io"),
                 30, "the RayZeroJob CRD")
        token = envtest.service_account_token("rzs", "rzo-rayzero-operator")
        operator = OperatorProcess(envtest.write_kubeconfig(token, "operator"), tmp_path).start()
        yield admin, Cluster(admin, "default"), operator
    finally:
        if operator is not None:
            operator.stop()
        envtest.stop()


def test_no_kuberay_is_reported_and_the_job_starts_once_it_is_installed(bare_cluster):
    admin, cluster, operator = bare_cluster
    cluster.create_job("early", example("minimal"))
    wait_for(lambda: cluster.condition("early", "Ready").get("reason") == "KubeRayNotInstalled",
             what="the KubeRayNotInstalled condition")
    assert cluster.status("early")["phase"] == "Pending"
    events = cluster.event("early", "KubeRayNotInstalled")
    assert len(events) == 1 and "install KubeRay" in events[0].message

    kuberay_crds.install(admin)
    wait_for(lambda: cluster.ray_jobs("early"), timeout=30, what="the RayJob once KubeRay is installed")
    # the pass that creates the RayJob says RayJobCreated; the next one, which sees it, WaitingForRayJob
    wait_for(lambda: cluster.condition("early", "Ready").get("reason") == "WaitingForRayJob",
             what="the WaitingForRayJob condition")
    assert cluster.status("early")["phase"] == "Pending"
    assert operator.running()
