"""Render the Helm chart's ServiceAccount and RBAC into deploy/rbac.yaml (for `kubectl apply` users
who do not use Helm), or check that the checked-in copy is current.

    python scripts/k8s_envtest_render.py --write
    python scripts/k8s_envtest_render.py --check     # `make crd-check` runs this in CI

Uses helm-python-sdk (Helm v4 as a library; no helm binary needed). Release `rayzero`, namespace
`rayzero-system`, default values.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "rayzero-operator"
TARGET = REPO / "deploy" / "rbac.yaml"
TEMPLATES = ("serviceaccount.yaml", "clusterrole.yaml", "clusterrolebinding.yaml")
HEADER = ("# Rendered from helm/rayzero-operator (release `rzo`, namespace rayzero-system) by\n"
          "# `python scripts/k8s_envtest_render.py --write`. Do not edit.\n")


def render() -> str:
    import helm_python

    rendered = helm_python.Chart.load(str(CHART)).render(None, name="rzo", namespace="rayzero-system",
                                                         is_install=True)
    docs = []
    for template in TEMPLATES:
        docs += [doc for doc in yaml.safe_load_all(rendered[f"rayzero-operator/templates/{template}"]) if doc]
    return HEADER + yaml.safe_dump_all(docs, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        TARGET.write_text(text)
        print(f"wrote {TARGET.relative_to(REPO)}")
        return 0
    if not TARGET.exists() or TARGET.read_text() != text:
        print(f"stale {TARGET.relative_to(REPO)}: run `python scripts/k8s_envtest_render.py --write`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
