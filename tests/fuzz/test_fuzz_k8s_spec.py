"""Fuzz the RayZeroJob spec validation: random specs over RayZeroJobSpec's camelCase keys, and the
examples under deploy/examples mutated. Property: the operator's `parse_spec` never raises; it
returns the parsed spec with every problem, each naming its field as a path from `spec` (the
InvalidSpec condition shows it); an accepted spec renders its RayJob. And every Kubernetes object name
(a RayZeroJob's name is its run name, `rayzero run --name`) is a valid run name."""
from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import given
from hypothesis import strategies as st
from rayzero_operator.manifests import ray_job
from rayzero_operator.spec import parse_spec
from strategies import examples, model_tree, mutated_json

from rayzero.config.k8s_job import DNS_SUBDOMAIN_PATTERN, RayZeroJobSpec
from rayzero.config.names import name_problem

EXAMPLES = [document for path in sorted((Path(__file__).parents[2] / "deploy" / "examples").glob("*.yaml"))
            for document in yaml.safe_load_all(path.read_text()) if isinstance(document, dict)]
JOB = {"apiVersion": "rayzero.io/v1alpha1", "kind": "RayZeroJob",
       "metadata": {"name": "fuzzed", "namespace": "default", "uid": "00000000-0000-0000-0000-000000000000"}}


def _check(raw) -> None:
    spec, problems = parse_spec(raw)
    for problem in problems:
        assert problem.field.startswith("spec") and problem.message and problem.fix, problem
    if spec is not None and not problems:
        ray_job({**JOB, "spec": raw}, spec, 1, None)


@examples(150)
@given(raw=model_tree(RayZeroJobSpec, depth=3))
def test_random_specs(raw):
    _check(raw)


@examples(150)
@given(data=st.data(), index=st.integers(0, len(EXAMPLES) - 1))
def test_mutated_example_specs(data, index):
    _check(data.draw(mutated_json(EXAMPLES[index]["spec"])))


@examples(100)
@given(name=st.from_regex(DNS_SUBDOMAIN_PATTERN, fullmatch=True).filter(lambda name: len(name) <= 253))
def test_every_kubernetes_name_is_a_run_name(name):
    assert name_problem(name) is None, name


def test_the_examples_parse():
    assert EXAMPLES and all(parse_spec(document["spec"])[1] == [] for document in EXAMPLES)
