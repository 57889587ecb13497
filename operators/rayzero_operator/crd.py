"""Generate the RayZeroJob CustomResourceDefinition from the pydantic models in `rayzero.config.k8s_job`.

    python -m rayzero_operator.crd --write   # regenerate the checked-in copies
    python -m rayzero_operator.crd --check   # exit 1 when a checked-in copy is stale (CI: make crd-check)

pydantic emits JSON Schema (2020-12); a CRD needs a *structural* OpenAPI v3 schema, which Kubernetes
1.20 checks strictly. The translation:
- `$ref`s are inlined (a CRD schema has no `$defs`); `title`s are dropped.
- `Optional[X]` (`anyOf: [X, {type: null}]`) becomes X, not required; `default: null` and
  `default: ""` are dropped (1.20 refuses an empty-string default).
- `additionalProperties: false` (a model that forbids extra keys) becomes
  `x-kubernetes-preserve-unknown-fields: true`: see [Note: unknown keys in a RayZeroJob].
- int-or-string and free-form objects come from the models' own `WithJsonSchema` annotations.

The DeepSpeed config is embedded as a free-form object rather than generated from the DeepSpeed
models: those use `int | "auto"` unions and cross-field rules that a structural schema cannot state
(1.20 has no CEL), and a second copy of the DeepSpeed schema in the CRD would drift from the models.
The operator validates it with `rayzero.config.load_config` and reports InvalidSpec.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

import yaml

from rayzero.config import k8s_job

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_FILE_NAME = f"{k8s_job.GROUP}_{k8s_job.PLURAL}.yaml"
CHECKED_IN = (
    REPO_ROOT / "deploy" / "crds" / CRD_FILE_NAME,
    REPO_ROOT / "helm" / "rayzero-operator" / "crds" / CRD_FILE_NAME,
)
HEADER = "# Generated from rayzero/config/k8s_job.py by `python -m rayzero_operator.crd --write`. Do not edit.\n"

_DROP = {"title", "$defs"}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Translate one pydantic JSON-schema node into a structural OpenAPI v3 node."""
    if isinstance(node, list):
        return [_structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**target, **node}  # the field's own description wins over the model's docstring
    if "anyOf" in node:
        options = [option for option in node["anyOf"] if option != {"type": "null"}]
        if len(options) == 1:
            node.pop("anyOf")
            node = {**options[0], **node}
            if "$ref" in node:
                return _structural(node, defs)
    if isinstance(node.get("description"), str):
        node["description"] = " ".join(node["description"].split())  # docstrings wrap; YAML reads better flat
    if node.get("default", 0) in (None, ""):
        node.pop("default")  # 1.20 stores `default: ""` as null and then refuses it
    if node.get("additionalProperties") is False:
        node.pop("additionalProperties")
        node["x-kubernetes-preserve-unknown-fields"] = True
    return {key: _structural(value, defs) for key, value in node.items() if key not in _DROP}


def openapi_schema(model: type) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of one pydantic model."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


def crd() -> dict[str, Any]:
    """The RayZeroJob CustomResourceDefinition as a dict."""
    spec_schema = openapi_schema(k8s_job.RayZeroJobSpec)
    status_schema = openapi_schema(k8s_job.RayZeroJobStatus)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{k8s_job.PLURAL}.{k8s_job.GROUP}",
            "labels": {"app.kubernetes.io/part-of": "rayzero"},
        },
        "spec": {
            "group": k8s_job.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": k8s_job.KIND,
                "listKind": f"{k8s_job.KIND}List",
                "plural": k8s_job.PLURAL,
                "singular": k8s_job.SINGULAR,
                "shortNames": list(k8s_job.SHORT_NAMES),
            },
            "versions": [
                {
                    "name": k8s_job.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                        {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
                        {"name": "Loss", "type": "number", "jsonPath": ".status.loss"},
                        {"name": "World", "type": "integer", "jsonPath": ".status.worldSize"},
                        {"name": "Checkpoint", "type": "integer", "jsonPath": ".status.lastCheckpointStep"},
                        {"name": "Failures", "type": "integer", "jsonPath": ".status.failures"},
                        {"name": "Goodput", "type": "number", "jsonPath": ".status.goodput"},
                        {"name": "Workers", "type": "integer", "jsonPath": ".status.workers", "priority": 1},
                        {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
                        {"name": "RayJob", "type": "string", "jsonPath": ".status.rayJobName",
                         "priority": 1},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A ZeRO training run on Ray, reconciled into KubeRay RayJobs "
                                           "by the rayzero operator.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


def render() -> str:
    """The CRD as the YAML text that is checked in."""
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayzero_operator.crd", description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate the checked-in CRD files")
    mode.add_argument("--check", action="store_true", help="fail when a checked-in CRD file is stale")
    args = parser.parse_args(argv)
    text = render()
    stale = []
    for path in CHECKED_IN:
        if args.write:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO_ROOT)}")
        elif not path.exists() or path.read_text() != text:
            stale.append(str(path.relative_to(REPO_ROOT)))
    if stale:
        print("stale CRD: " + ", ".join(stale) + "\n"
              "rayzero/config/k8s_job.py changed; run `python -m rayzero_operator.crd --write` and commit.",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
