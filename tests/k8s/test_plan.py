"""The operator's decisions as pure functions (no cluster): the branches the apiserver tests cannot
reach quickly — backoff timing, a status lost, a finished job's RayJob deleted, a spec edited mid-run."""
from __future__ import annotations

import copy
import datetime as dt
from typing import Any

import pytest
import yaml
from rayzero_operator import crd, manifests
from rayzero_operator.plan import Observed, plan
from testkit.k8s_support import example

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def _job(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "j", "namespace": "ns", "uid": "u-1", "generation": 3},
            "spec": spec or example("minimal"), "status": status or {}}


def _ray_job(job: dict[str, Any], attempt: int, **status: Any) -> dict[str, Any]:
    from rayzero.config.k8s_job import RayZeroJobSpec

    made = manifests.ray_job(job, RayZeroJobSpec.model_validate(job["spec"]), attempt, None)
    made["status"] = status
    return made


def _ago(seconds: float) -> str:
    return (NOW - dt.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_a_new_job_gets_its_config_map_and_first_rayjob():
    decided = plan(Observed(_job(), [], now=NOW))
    # the token Secret first: the RayJob's pods read their tokens from it
    assert [item["kind"] for item in decided.create] == ["Secret", "ConfigMap", "RayJob"]
    assert decided.create[2]["metadata"]["name"] == "j-attempt-1"
    assert decided.status["phase"] == "Pending" and decided.status["attempt"] == 1
    assert decided.status["observedGeneration"] == 3
    assert [event[1] for event in decided.events] == ["RayJobCreated"]


def test_the_backoff_is_timed_from_the_rayjob_end():
    spec = example("minimal")
    spec["failurePolicy"] = {"maxRestarts": 2, "backoffSeconds": 30}
    spec["storage"] = {"durableUri": "s3://b/p/"}
    job = _job(spec)
    waiting = plan(Observed(job, [_ray_job(job, 1, jobStatus="FAILED", endTime=_ago(10))], now=NOW))
    assert waiting.create == [] and 19 < waiting.requeue_after <= 20
    assert waiting.status["phase"] == "Restarting"

    due = plan(Observed(job, [_ray_job(job, 1, jobStatus="FAILED", endTime=_ago(31))], now=NOW))
    # The ConfigMap is written again too: a new attempt runs the spec's current config.
    assert [item["kind"] for item in due.create] == ["Secret", "ConfigMap", "RayJob"]
    second = due.create[2]
    assert second["metadata"]["name"] == "j-attempt-2"
    env = yaml.safe_load(second["spec"]["runtimeEnvYAML"])["env_vars"]
    assert env == {"RAYZERO_RESUME_FROM": "s3://b/p/j"}
    assert (due.status["attempt"], due.status["restarts"], due.status["resumeFrom"]) == (2, 1, "s3://b/p/j")


def test_restarts_exhausted_is_final():
    spec = example("minimal")
    spec["failurePolicy"] = {"maxRestarts": 1, "backoffSeconds": 0}
    job = _job(spec)
    ray_jobs = [_ray_job(job, 1, jobStatus="FAILED"), _ray_job(job, 2, jobDeploymentStatus="Failed",
                                                                  message="OOM")]
    decided = plan(Observed(job, ray_jobs, now=NOW))
    assert decided.create == [] and decided.status["phase"] == "Failed"
    failed = next(c for c in decided.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "RestartsExhausted" and "OOM" in failed["message"]


def test_a_lost_status_is_rebuilt_from_the_rayjobs():
    job = _job()
    ray_jobs = [_ray_job(job, 1, jobStatus="FAILED"), _ray_job(job, 2, jobStatus="RUNNING")]
    decided = plan(Observed(job, ray_jobs, now=NOW))
    assert decided.create == []
    assert (decided.status["phase"], decided.status["attempt"], decided.status["restarts"]) == ("Running", 2, 1)


def test_a_finished_job_whose_rayjob_was_deleted_is_not_run_again():
    job = _job(status={"phase": "Succeeded", "attempt": 1})
    decided = plan(Observed(job, [], now=NOW))
    assert decided.create == [] and decided.status["phase"] == "Succeeded"


def test_a_spec_made_invalid_mid_run_touches_nothing():
    job = _job()
    running = [_ray_job(job, 1, jobStatus="RUNNING")]
    broken = copy.deepcopy(job)
    broken["spec"]["workers"]["minReplicas"] = 5
    decided = plan(Observed(broken, running, now=NOW))
    assert decided.create == [] and decided.patch_ray_job is None
    assert decided.status["phase"] == "Running"
    invalid = next(c for c in decided.status["conditions"] if c["type"] == "InvalidSpec")
    assert invalid["status"] == "True" and "spec.workers.minReplicas" in invalid["message"]


def test_conditions_keep_their_transition_time_while_unchanged():
    job = _job()
    running = [_ray_job(job, 1, jobStatus="RUNNING")]
    first = plan(Observed(job, running, now=NOW))
    later = plan(Observed(_job(status=first.status), running, now=NOW + dt.timedelta(minutes=5)))
    assert later.status == first.status and later.events == []


def test_the_generated_crd_is_structural():
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            assert not {"$ref", "$defs", "anyOf", "title"} & node.keys(), path
            assert node.get("additionalProperties") is not False, path
            if "properties" in node:
                assert node.get("type") == "object", path
            for key, value in node.items():
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for item in node:
                walk(item, path)

    walk(schema, "")
    spec = schema["properties"]["spec"]
    assert spec["required"] == ["image", "entrypoint", "deepspeed", "workers"]
    assert spec["properties"]["deepspeed"]["properties"]["config"]["x-kubernetes-preserve-unknown-fields"]
    assert spec["x-kubernetes-preserve-unknown-fields"]  # typos reach the operator (see k8s_job.py)


def test_a_name_too_long_for_its_rayjobs_is_refused():
    job = _job()
    job["metadata"]["name"] = "n" * (manifests.MAX_JOB_NAME_LENGTH + 1)
    decided = plan(Observed(job, [], now=NOW))
    assert decided.create == [] and decided.status["phase"] == "Failed"
    assert "metadata.name" in decided.events[0][2]


def test_host_paths_are_matched_per_component_against_the_operators_allowed_roots():
    from rayzero_operator.spec import parse_allowed_host_paths

    def verdict(host_path: str, allowed: tuple[str, ...] = ("/mnt/nvme/rayzero",)) -> str:
        spec = example("minimal")
        spec["storage"] = {"nodeLocal": {"hostPath": host_path}}
        decided = plan(Observed(_job(spec), [], now=NOW, allowed_host_paths=allowed))
        invalid = next(c for c in decided.status["conditions"] if c["type"] == "InvalidSpec")
        return "refused" if invalid["status"] == "True" else "allowed"

    assert verdict("/mnt/nvme/rayzero") == verdict("/mnt/nvme/rayzero/team-a") == "allowed"
    assert verdict("/etc") == verdict("/mnt/nvme") == verdict("/mnt/nvme/rayzero-other") == "refused"
    assert verdict("/data/x", ("/data", "/scratch")) == "allowed" and verdict("/mnt/nvme/rayzero", ()) == "refused"
    assert parse_allowed_host_paths(None) == ("/mnt/nvme/rayzero",) and parse_allowed_host_paths("[]") == ()
    for bad in ('["relative"]', '["/"]', '["/a/../b"]', "not json", '"/a"'):
        with pytest.raises(ValueError, match="RAYZERO_OPERATOR_ALLOWED_HOST_PATHS"):
            parse_allowed_host_paths(bad)
