"""Render the Helm chart's ServiceAccount and RBAC into deploy/ (for `kubectl apply` users who do not
use Helm), or check that the checked-in copies are current.

    python scripts/k8s_envtest_render.py --write
    python scripts/k8s_envtest_render.py --check     # `make crd-check` runs this in CI

Uses helm-python-sdk (Helm v4 as a library; no helm binary needed). Release `rzo`, namespace
`rayzero-system`: deploy/rbac.yaml with the default values (cluster-wide), and
deploy/rbac-namespaced.yaml with `watchNamespaces: [rayzero-jobs]` (a Role per watched namespace).
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "rayzero-operator"
# (target, values, templates rendered into it)
RENDERED = (
    (REPO / "deploy" / "rbac.yaml", None, ("serviceaccount.yaml", "clusterrole.yaml", "clusterrolebinding.yaml")),
    (REPO / "deploy" / "rbac-namespaced.yaml", {"watchNamespaces": ["rayzero-jobs"]},
     ("serviceaccount.yaml", "roles.yaml", "rolebindings.yaml")),
)
TARGET = RENDERED[0][0]
HEADER = ("# Rendered from helm/rayzero-operator (release `rzo`, namespace rayzero-system{values}) by\n"
          "# `python scripts/k8s_envtest_render.py --write`. Do not edit.\n")


def render(values: dict | None = None, templates: tuple[str, ...] = RENDERED[0][2]) -> str:
    import helm_python

    rendered = helm_python.Chart.load(str(CHART)).render(values, name="rzo", namespace="rayzero-system",
                                                         is_install=True)
    docs = []
    for template in templates:
        docs += [doc for doc in yaml.safe_load_all(rendered[f"rayzero-operator/templates/{template}"]) if doc]
    shown = "" if values is None else ", values " + ", ".join(f"{key}: {value}" for key, value in values.items())
    return HEADER.format(values=shown) + yaml.safe_dump_all(docs, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    stale = []
    for target, values, templates in RENDERED:
        text = render(values, templates)
        if args.write:
            target.write_text(text)
            print(f"wrote {target.relative_to(REPO)}")
        elif not target.exists() or target.read_text() != text:
            stale.append(str(target.relative_to(REPO)))
    if stale:
        print(f"stale {', '.join(stale)}: run `python scripts/k8s_envtest_render.py --write`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
