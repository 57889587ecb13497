"""The Helm chart through helm-python-sdk (Helm v4, no helm binary): lint, render per template,
install into the real apiserver (the session's `release` fixture), values schema enforced, and the
checked-in deploy/ manifests up to date with the chart and the models."""
from __future__ import annotations

import pathlib

import helm_python
import pytest
import yaml
from kubernetes import client
from rayzero_operator import crd as crd_module
from testkit.k8s_support import CHART, RELEASE, RELEASE_NAMESPACE, SERVICE_ACCOUNT

REPO = pathlib.Path(__file__).resolve().parents[2]
TEMPLATES = "rayzero-operator/templates/"


def _render(values: dict | None = None) -> dict[str, list[dict]]:
    rendered = helm_python.Chart.load(str(CHART)).render(values, name=RELEASE, namespace=RELEASE_NAMESPACE,
                                                         is_install=True)
    return {path[len(TEMPLATES):]: [doc for doc in yaml.safe_load_all(text) if doc]
            for path, text in rendered.items() if path.endswith(".yaml")}


def test_the_chart_lints_clean():
    report = helm_python.lint(str(CHART), strict=True, kube_version="v1.20.2")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_each_template_holds_one_kind_of_resource():
    kinds = {path: sorted({doc["kind"] for doc in docs}) for path, docs in _render().items()}
    assert kinds == {"serviceaccount.yaml": ["ServiceAccount"], "clusterrole.yaml": ["ClusterRole"],
                     "clusterrolebinding.yaml": ["ClusterRoleBinding"], "deployment.yaml": ["Deployment"],
                     "roles.yaml": [], "rolebindings.yaml": []}


def _granted(role: dict) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def test_the_clusterrole_grants_exactly_what_the_operator_uses():
    (role,) = _render()["clusterrole.yaml"]
    granted = _granted(role)
    uses = {
        ("rayzero.io", "rayzerojobs", verb) for verb in ("get", "list", "watch", "patch")} | {
        ("rayzero.io", "rayzerojobs/status", "patch"), ("rayzero.io", "rayzerojobs/finalizers", "update")} | {
        ("ray.io", "rayjobs", verb) for verb in ("list", "watch", "create", "patch", "delete")} | {
        ("", "configmaps", verb) for verb in ("get", "create", "patch", "delete")} | {("", "events", "create")} | {
        # the job's Secret (patch: its control credentials per attempt); never list/watch
        ("", "secrets", verb) for verb in ("get", "create", "patch", "delete")}
    assert granted == uses


def test_watch_namespaces_makes_a_namespaced_install_with_no_cluster_wide_permission():
    rendered = _render({"watchNamespaces": ["team-a", "team-b"]})
    assert rendered["clusterrole.yaml"] == [] and rendered["clusterrolebinding.yaml"] == []
    (cluster_role,) = _render()["clusterrole.yaml"]
    roles = rendered["roles.yaml"]
    assert [(doc["kind"], doc["metadata"]["namespace"]) for doc in roles] == [("Role", "team-a"), ("Role", "team-b")]
    assert all(_granted(role) == _granted(cluster_role) for role in roles)  # the same rules, namespaced
    bindings = rendered["rolebindings.yaml"]
    assert [doc["metadata"]["namespace"] for doc in bindings] == ["team-a", "team-b"]
    assert all(doc["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": f"{RELEASE}-rayzero-operator"} for doc in bindings)
    (deployment,) = rendered["deployment.yaml"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_values_reach_the_deployment():
    (deployment,) = _render({"image": {"repository": "r.example/op", "tag": "9.9", "pullPolicy": "Always"},
                             "resyncSeconds": 7, "verbose": True, "controlRefreshSeconds": 2})["deployment.yaml"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "r.example/op:9.9" and container["imagePullPolicy"] == "Always"
    assert {"name": "RAYZERO_OPERATOR_RESYNC_S", "value": "7"} in container["env"]
    assert {"name": "RAYZERO_OPERATOR_CONTROL_REFRESH_S", "value": "2"} in container["env"]
    assert {"name": "RAYZERO_OPERATOR_CHECKPOINT_TIMEOUT_S", "value": "600"} in container["env"]
    assert {"name": "RAYZERO_OPERATOR_ALLOWED_HOST_PATHS", "value": '["/mnt/nvme/rayzero"]'} in container["env"]
    assert "--verbose" in container["args"]
    (other,) = _render({"allowedHostPaths": ["/data/a", "/scratch"]})["deployment.yaml"]
    env = other["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "RAYZERO_OPERATOR_ALLOWED_HOST_PATHS", "value": '["/data/a","/scratch"]'} in env
    assert deployment["spec"]["strategy"]["type"] == "Recreate"


@pytest.mark.parametrize("values,where", [
    ({"resyncSeconds": "often"}, "/resyncSeconds"),
    ({"image": {"repository": "x", "pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"watchNamespaces": "team-a"}, "/watchNamespaces"),
    ({"resyncSecond": 5}, "resyncSecond"),
    ({"controlRefreshSeconds": 0}, "/controlRefreshSeconds"),
    ({"allowedHostPaths": ["nvme"]}, "/allowedHostPaths/0"),
    ({"allowedHostPaths": ["/"]}, "/allowedHostPaths/0"),
    ({"allowedHostPaths": ["/mnt/nvme/../../etc"]}, "/allowedHostPaths/0"),
    ({"allowedHostPaths": "/mnt/nvme"}, "/allowedHostPaths"),
])
def test_the_values_schema_refuses_wrong_values(values, where):
    with pytest.raises(helm_python.HelmValuesError) as raised:
        helm_python.Chart.load(str(CHART)).validate_schema(values)
    assert where in str(raised.value)


def test_the_chart_installed_into_the_apiserver(release, admin):
    assert release["name"] == RELEASE
    rbac = client.RbacAuthorizationV1Api(admin)
    role = rbac.read_cluster_role(f"{RELEASE}-rayzero-operator")
    assert {rule.api_groups[0] for rule in role.rules} == {"rayzero.io", "ray.io", ""}
    binding = rbac.read_cluster_role_binding(f"{RELEASE}-rayzero-operator")
    assert binding.subjects[0].name == SERVICE_ACCOUNT
    client.CoreV1Api(admin).read_namespaced_service_account(SERVICE_ACCOUNT, RELEASE_NAMESPACE)
    client.AppsV1Api(admin).read_namespaced_deployment(f"{RELEASE}-rayzero-operator", RELEASE_NAMESPACE)
    crd = client.ApiextensionsV1Api(admin).read_custom_resource_definition("rayzerojobs.rayzero.io")
    columns = [column.name for column in crd.spec.versions[0].additional_printer_columns]
    assert columns == ["Phase", "Step", "Loss", "World", "Checkpoint", "Failures", "Goodput", "Workers", "Restarts", "RayJob",
                       "Age"]
    assert crd.spec.names.short_names == ["rzj"] and crd.spec.versions[0].subresources.status is not None


def test_an_install_with_a_wrong_typed_value_is_refused(envtest, release, admin):
    helm = helm_python.Config(kubeconfig_path=str(envtest.admin_kubeconfig), namespace="wrong-values")
    with pytest.raises(helm_python.HelmError) as raised:
        helm.install(helm_python.Chart.load(str(CHART)), "wrong", {"livenessPort": "http"},
                     namespace="wrong-values", create_namespace=True, timeout=30)
    assert "livenessPort" in str(raised.value)
    assert client.AppsV1Api(admin).list_namespaced_deployment("wrong-values").items == []


def test_checked_in_crds_are_generated_from_the_models():
    assert crd_module.main(["--check"]) == 0, "run `python -m rayzero_operator.crd --write`"


def test_deploy_rbac_is_the_rendered_chart_rbac():
    rendered = _render()
    expected = [*rendered["serviceaccount.yaml"], *rendered["clusterrole.yaml"],
                *rendered["clusterrolebinding.yaml"]]
    checked_in = [doc for doc in yaml.safe_load_all((REPO / "deploy" / "rbac.yaml").read_text()) if doc]
    assert checked_in == expected, "regenerate deploy/rbac.yaml: python scripts/k8s_envtest_render.py"
    namespaced = _render({"watchNamespaces": ["rayzero-jobs"]})
    expected = [*namespaced["serviceaccount.yaml"], *namespaced["roles.yaml"], *namespaced["rolebindings.yaml"]]
    checked_in = [doc for doc in yaml.safe_load_all((REPO / "deploy" / "rbac-namespaced.yaml").read_text()) if doc]
    assert checked_in == expected, "regenerate deploy/rbac-namespaced.yaml: python scripts/k8s_envtest_render.py"


def test_notes_say_what_is_watched_and_how_to_start():
    chart = helm_python.Chart.load(str(CHART))
    notes = chart.render({"watchNamespaces": ["team-a"]}, name=RELEASE, namespace=RELEASE_NAMESPACE,
                         is_install=True)["rayzero-operator/templates/NOTES.txt"]
    assert "namespaces team-a" in notes and "KubeRay" in notes and "kubectl get rayzerojobs" in notes
