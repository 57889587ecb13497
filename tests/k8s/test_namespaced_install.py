"""Issue 22: the chart's namespaced install. With `watchNamespaces` the operator gets a Role in each
watched namespace and nothing cluster-wide; run with exactly that (its ServiceAccount's token), it
runs jobs there, and it can read no Secret and list nothing anywhere else."""
from __future__ import annotations

import uuid

import helm_python
import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from testkit.k8s_support import CHART, Cluster, OperatorProcess, example, labelled_credentials, wait_for

RELEASE, NAMESPACE = "rzn", "rzn-system"


def test_a_namespaced_install_runs_jobs_there_and_reaches_nothing_elsewhere(
        envtest, admin, release, operator_process, tmp_path):
    operator_process.stop()  # the session's cluster-wide operator would reconcile these jobs too
    watched, elsewhere = (Cluster(admin, f"{prefix}-{uuid.uuid4().hex[:6]}") for prefix in ("team", "other"))
    for cluster in (watched, elsewhere):
        client.CoreV1Api(admin).create_namespace({"metadata": {"name": cluster.namespace}})
    with helm_python.Config(kubeconfig_path=str(envtest.admin_kubeconfig), namespace=NAMESPACE) as helm:
        helm.install(helm_python.Chart.load(str(CHART)), RELEASE, {"watchNamespaces": [watched.namespace]},
                     namespace=NAMESPACE, create_namespace=True, timeout=60)
    rbac = client.RbacAuthorizationV1Api(admin)
    with pytest.raises(ApiException) as missing:
        rbac.read_cluster_role(f"{RELEASE}-rayzero-operator")
    assert missing.value.status == 404  # no cluster-wide role at all
    assert rbac.read_namespaced_role(f"{RELEASE}-rayzero-operator", watched.namespace).rules

    account = f"{RELEASE}-rayzero-operator"
    kubeconfig = envtest.write_kubeconfig(envtest.service_account_token(NAMESPACE, account),
                                          f"system:serviceaccount:{NAMESPACE}:{account}")
    namespaced = OperatorProcess(kubeconfig, tmp_path).start(watched.namespace)
    try:
        labelled_credentials(watched, "bucket")
        spec = example("minimal")
        spec["storage"] = {"credentialsSecret": "bucket", "durableUri": "s3://b/runs"}
        watched.create_job("here", spec)
        wait_for(lambda: watched.ray_jobs("here"), 30, "the RayJob in the watched namespace")
        wait_for(watched.phase_is("here", "Pending"), 30, "phase Pending")
        assert watched.secret("here-rayzero-auth") is not None

        as_operator = config.new_client_from_config(config_file=str(kubeconfig))
        core, custom = client.CoreV1Api(as_operator), client.CustomObjectsApi(as_operator)
        labelled_credentials(elsewhere, "their-bucket")
        for forbidden in (lambda: core.read_namespaced_secret("their-bucket", elsewhere.namespace),
                          lambda: core.list_namespaced_secret(watched.namespace),
                          lambda: custom.list_cluster_custom_object("rayzero.io", "v1alpha1", "rayzerojobs"),
                          lambda: custom.list_namespaced_custom_object("rayzero.io", "v1alpha1", elsewhere.namespace,
                                                                       "rayzerojobs")):
            with pytest.raises(ApiException) as refused:
                forbidden()
            assert refused.value.status == 403
        refusals = [line for line in namespaced.log().splitlines() if "orbidden" in line or "(403)" in line]
        assert refusals == []  # everything it did, it was allowed to do
    finally:
        namespaced.stop()
