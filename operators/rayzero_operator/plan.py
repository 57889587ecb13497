"""Decide what one reconcile does (pure: no API calls, so every branch is unit-testable).

The operator is level-triggered: whatever event woke it, it reads the RayZeroJob, the RayJobs it
owns and the referenced ConfigMap, and `plan` returns the whole answer — objects to create, one
RayJob patch, the status to write, Events to post and when to look again. Running a plan twice
changes nothing the second time (see [Note: one RayJob per attempt]).

[Note: one retry budget]
Two levels, each with one budget. Inside a RayJob, `rayzero run`'s controller restarts the worker
group from the newest checkpoint after a lost worker, hang or node, with its default policy (no
total limit while the run keeps committing checkpoints; 3 failures in a row without a newer one end
the RayJob; `status.failures` counts them): cheap, on the Ray cluster it has. When a RayJob itself
fails (the policy gave up, the head pod was lost), `spec.failurePolicy.maxRestarts` decides: every
RayJob is created with KubeRay's `backoffLimit: 0`, and when attempt n fails with restarts left
(n - 1 < maxRestarts) the operator waits `backoffSeconds` and creates attempt n + 1, which resumes
from the run's durable checkpoints through RAYZERO_RESUME_FROM. `status.restarts` is n - 1 of the
newest attempt.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

import yaml

from rayzero.config.environment import RESUME_FROM
from rayzero.config.k8s_job import RayZeroJobSpec
from rayzero_operator import manifests
from rayzero_operator.spec import (
    DEFAULT_ALLOWED_HOST_PATHS,
    SpecProblem,
    credentials_problems,
    deepspeed_problems,
    parse_spec,
    storage_problems,
)

TERMINAL = ("Succeeded", "Failed")


@dataclass
class Observed:
    """What one reconcile read from the cluster."""

    job: dict[str, Any]
    """The RayZeroJob object (metadata, spec, status)."""
    ray_jobs: list[dict[str, Any]]
    """The RayJobs labelled as this job's attempts."""
    config_map_text: str | None = None
    """The referenced ConfigMap's config text; None when absent or not referenced."""
    kuberay_missing: bool = False
    """The cluster does not serve ray.io/v1 RayJobs (KubeRay is not installed)."""
    generated_config_map_labels: dict[str, str] | None = None
    """Labels of the ConfigMap named `<job>-deepspeed`, if one exists (ours, or somebody else's)."""
    credentials_secret: dict[str, Any] | None = None
    """`{"type", "labels"}` of the Secret `spec.storage.credentialsSecret` names; None when absent."""
    allowed_host_paths: tuple[str, ...] = DEFAULT_ALLOWED_HOST_PATHS
    """The operator's allowedHostPaths (Helm value)."""
    now: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc))


@dataclass
class Plan:
    """What to do, in order: create, patch, then write status and post events."""

    create: list[dict[str, Any]] = field(default_factory=list)
    """Objects to create (the ConfigMap before the RayJob); AlreadyExists is success."""
    patch_ray_job: tuple[str, dict[str, Any]] | None = None
    """(RayJob name, merge patch), for suspend and un-suspend."""
    status: dict[str, Any] = field(default_factory=dict)
    """The full status to write (camelCase, as stored)."""
    events: list[tuple[str, str, str]] = field(default_factory=list)
    """(type, reason, message) Events about the RayZeroJob."""
    requeue_after: float | None = None
    """Seconds until the operator must look again even without an event (backoff)."""


def attempt_of(ray_job: dict[str, Any]) -> int:
    return int(ray_job["metadata"].get("labels", {}).get(manifests.LABEL_ATTEMPT, "0"))


def attempt_state(ray_job: dict[str, Any]) -> str:
    """pending, running, suspended, succeeded or failed, from the status KubeRay writes."""
    status = ray_job.get("status") or {}
    deployment = status.get("jobDeploymentStatus", "")
    job_status = status.get("jobStatus", "")
    if job_status == "SUCCEEDED":
        return "succeeded"
    if deployment in ("Suspended", "Suspending"):
        return "suspended"  # KubeRay reports a suspended job's driver as STOPPED: not a failure
    if deployment == "Failed" or job_status in ("FAILED", "STOPPED"):
        return "failed"
    if job_status == "RUNNING" or deployment == "Running":
        return "running"
    return "pending"


def _timestamp(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def _format(moment: dt.datetime) -> str:
    return moment.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _conditions(old: list[dict[str, Any]], new: dict[str, tuple[str, str, str]], now: dt.datetime
                ) -> list[dict[str, Any]]:
    """Conditions in a fixed order; lastTransitionTime moves when the status or the reason changes
    (the backoff is timed from the Ready condition turning BackingOff)."""
    previous = {condition.get("type"): condition for condition in old}
    out = []
    for kind, (status, reason, message) in new.items():
        before = previous.get(kind, {})
        same = before.get("status") == status and before.get("reason") == reason
        since = before.get("lastTransitionTime") if same else None
        condition = {"type": kind, "status": status, "reason": reason, "message": message,
                     "lastTransitionTime": since or _format(now)}
        # Omit empty strings: the 1.20 apiserver built here reads "" back as null and then refuses it.
        out.append({key: value for key, value in condition.items() if value != ""})
    return out


def _problem_text(problems: list[SpecProblem]) -> str:
    return "; ".join(str(problem) for problem in problems)


def _check(observed: Observed) -> tuple[RayZeroJobSpec | None, list[SpecProblem]]:
    """The parsed spec and every problem with it, the referenced ConfigMap's content included."""
    job = observed.job
    name = job["metadata"]["name"]
    spec, problems = parse_spec(job.get("spec") or {})
    if len(name) > manifests.MAX_JOB_NAME_LENGTH:
        problems.insert(0, SpecProblem(
            "metadata.name", f"{name!r} has {len(name)} characters; `<name>-attempt-<n>` must stay a "
            "63-character label value for KubeRay", f"use at most {manifests.MAX_JOB_NAME_LENGTH} characters"))
    if spec is not None and spec.deepspeed.config_map_ref is not None:
        ref = spec.deepspeed.config_map_ref
        if observed.config_map_text is None:
            problems.append(SpecProblem(
                "spec.deepspeed.configMapRef", f"ConfigMap {ref.name!r} with key {ref.key!r} was not found "
                f"in namespace {job['metadata']['namespace']!r}", "create it, or fix the name and key"))
        else:
            problems += deepspeed_problems(observed.config_map_text, spec.world_size(),
                                           f"spec.deepspeed.configMapRef({ref.name}/{ref.key})")
    if spec is not None:
        problems += storage_problems(spec, observed.allowed_host_paths)
        problems += credentials_problems(spec, observed.credentials_secret, job["metadata"]["namespace"])
    taken = observed.generated_config_map_labels
    if (spec is not None and spec.deepspeed.config is not None and taken is not None
            and taken.get(manifests.LABEL_JOB) != name):
        problems.append(SpecProblem(
            "metadata.name", f"ConfigMap {manifests.config_map_name(name)!r} exists and does not belong to "
            "this job; the operator writes the inline DeepSpeed config there and will not overwrite it",
            "rename the RayZeroJob, or delete or rename that ConfigMap"))
    return spec, problems


def plan(observed: Observed) -> Plan:
    job = observed.job
    name = job["metadata"]["name"]
    old_status = job.get("status") or {}
    result = Plan()
    spec, problems = _check(observed)

    by_attempt = {attempt_of(ray_job): ray_job for ray_job in observed.ray_jobs}
    newest = max(by_attempt, default=0)
    recorded = int(old_status.get("attempt") or 0)
    attempt = max(newest, recorded)
    latest = by_attempt.get(attempt)
    state = attempt_state(latest) if latest is not None else "absent"
    phase: str
    reason, message = "", ""

    if problems:
        text = _problem_text(problems)
        if old_status.get("conditions") is None or not any(
                c.get("type") == "InvalidSpec" and c.get("status") == "True" and c.get("message") == text
                for c in old_status.get("conditions", [])):
            result.events.append(("Warning", "InvalidSpec", text))
    if observed.kuberay_missing:
        phase, reason = "Pending", "KubeRayNotInstalled"
        message = ("this cluster does not serve ray.io/v1 RayJobs: install KubeRay (v1.6 or later); "
                   "the job starts once it is there")
        if not any(c.get("reason") == reason for c in old_status.get("conditions") or []):
            result.events.append(("Warning", reason, message))
    elif latest is None and attempt > 0 and old_status.get("phase") in TERMINAL:
        # A finished run whose RayJob was deleted by hand stays finished: never start it again.
        phase, reason, message = old_status["phase"], "RayJobDeleted", f"RayJob of attempt {attempt} is gone"
    elif latest is None:
        if problems:
            phase, reason, message = "Failed", "InvalidSpec", "nothing was created: " + _problem_text(problems)
        else:
            attempt = max(attempt, 1)
            assert spec is not None
            resume = manifests.resume_uri(spec, name) if attempt > 1 else None
            _start(result, job, spec, attempt, resume)
            phase = "Suspended" if spec.suspend else ("Restarting" if attempt > 1 else "Pending")
            reason, message = "RayJobCreated", f"created RayJob {manifests.ray_job_name(name, attempt)}"
    else:
        phase, reason, message = _follow(result, observed, spec, problems, attempt, latest, state)

    # The status describes the newest attempt: the one just planned, if any.
    current = next((item for item in result.create if item["kind"] == "RayJob"), latest)
    if current is not None:
        attempt = attempt_of(current)
    result.status = _status(observed, phase, reason, message, problems, attempt, current)
    if phase != old_status.get("phase") and phase in TERMINAL:
        result.events.append(("Normal" if phase == "Succeeded" else "Warning", reason, message))
    return result


def _status(observed: Observed, phase: str, reason: str, message: str, problems: list[SpecProblem],
            attempt: int, current: dict[str, Any] | None) -> dict[str, Any]:
    """The whole status to write, describing attempt `attempt` whose RayJob is `current`."""
    job = observed.job
    restarts = max(attempt - 1, 0)
    resume_from = None
    workers = 0
    if current is not None:
        env = yaml.safe_load(current["spec"].get("runtimeEnvYAML") or "{}") or {}
        resume_from = (env.get("env_vars") or {}).get(RESUME_FROM.name)
        workers = current["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].get("replicas", 0)
    conditions = {
        "Ready": ("True", "Running", message) if phase == "Running" else ("False", reason or phase, message),
        "InvalidSpec": ("True", "InvalidSpec", _problem_text(problems)) if problems
        else ("False", "SpecValid", "the spec passed every check"),
        "Suspended": ("True", "Suspended", "spec.suspend is true") if phase == "Suspended"
        else ("False", "NotSuspended", ""),
        "Succeeded": ("True", reason, message) if phase == "Succeeded" else ("False", "NotFinished", ""),
        "Failed": ("True", reason, message) if phase == "Failed" else ("False", "NotFailed", ""),
    }
    return {
        "phase": phase,
        "restarts": restarts,
        "attempt": attempt,
        "rayJobName": manifests.ray_job_name(job["metadata"]["name"], attempt) if attempt > 0 else None,
        "workers": workers,
        "resumeFrom": resume_from,
        "observedGeneration": job["metadata"].get("generation"),
        "conditions": _conditions((job.get("status") or {}).get("conditions") or [], conditions, observed.now),
    }


def _start(result: Plan, job: dict[str, Any], spec: RayZeroJobSpec, attempt: int,
           resume: str | None) -> None:
    # New control credentials for this attempt; Ray's token is kept ([Note: the job's tokens]).
    result.create.append(manifests.auth_secret(job, attempt))
    if spec.deepspeed.config is not None:
        result.create.append(manifests.config_map(job, spec))
    result.create.append(manifests.ray_job(job, spec, attempt, resume))
    verb = "started" if attempt == 1 else "restarted"
    where = f", resuming from {resume}" if resume else (
        ", from step 0: no spec.storage.durableUri to resume from" if attempt > 1 else "")
    name = manifests.ray_job_name(job["metadata"]["name"], attempt)
    message = f"{verb} as RayJob {name} (attempt {attempt}){where}"
    result.events.append(("Normal" if attempt == 1 or resume else "Warning", "RayJobCreated", message))


def _follow(result: Plan, observed: Observed, spec: RayZeroJobSpec | None, problems: list[SpecProblem],
            attempt: int, latest: dict[str, Any], state: str) -> tuple[str, str, str]:
    """Phase, reason and message from the newest attempt's RayJob; may start the next attempt."""
    job = observed.job
    name = job["metadata"]["name"]
    ray_job_name = latest["metadata"]["name"]
    kuberay = latest.get("status") or {}
    detail = kuberay.get("message") or kuberay.get("reason") or ""
    if state == "succeeded":
        return "Succeeded", "RayJobSucceeded", f"RayJob {ray_job_name} succeeded (attempt {attempt})"
    if state == "failed":
        failure = f"RayJob {ray_job_name} failed" + (f": {detail}" if detail else "")
        if spec is None or problems:
            return "Failed", "InvalidSpec", f"{failure}; no restart while the spec is invalid"
        budget = spec.failure_policy.max_restarts
        if attempt - 1 >= budget:
            return "Failed", "RestartsExhausted", f"{failure}; all {budget} restart(s) used"
        failed_at = _timestamp(kuberay.get("endTime")) or _restarting_since(job) or observed.now
        wait = (failed_at + dt.timedelta(seconds=spec.failure_policy.backoff_seconds) - observed.now)
        if wait.total_seconds() > 0:
            result.requeue_after = wait.total_seconds()
            return "Restarting", "BackingOff", f"{failure}; attempt {attempt + 1} in {wait.total_seconds():.0f}s"
        _start(result, job, spec, attempt + 1, manifests.resume_uri(spec, name))
        return "Restarting", "AttemptFailed", f"{failure}; started attempt {attempt + 1} of {budget + 1}"
    if spec is not None and bool(latest["spec"].get("suspend", False)) != spec.suspend:
        patch: dict[str, Any] = {"spec": {"suspend": spec.suspend}}
        resume = manifests.resume_uri(spec, name)
        if not spec.suspend and resume is not None:
            # An un-suspended RayJob starts its entrypoint again: let it resume, not restart from 0.
            patch["spec"]["runtimeEnvYAML"] = manifests.runtime_env_yaml(resume)
        result.patch_ray_job = (ray_job_name, patch)
        result.events.append(("Normal", "Suspended" if spec.suspend else "Resumed",
                              f"{'suspended' if spec.suspend else 'resumed'} RayJob {ray_job_name}"))
        if spec.suspend:
            return "Suspended", "Suspending", f"suspending RayJob {ray_job_name}"
        return "Pending", "Resuming", f"resuming RayJob {ray_job_name}"
    if state == "suspended" or (spec is not None and spec.suspend):
        return "Suspended", "Suspended", f"RayJob {ray_job_name} is suspended"
    if state == "running":
        return "Running", "RayJobRunning", f"RayJob {ray_job_name} is running (attempt {attempt})"
    if attempt > 1:
        return "Restarting", "WaitingForRayJob", f"waiting for RayJob {ray_job_name} (attempt {attempt}) to start"
    return "Pending", "WaitingForRayJob", f"waiting for RayJob {ray_job_name} to start"


def _restarting_since(job: dict[str, Any]) -> dt.datetime | None:
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready" and condition.get("reason") == "BackingOff":
            return _timestamp(condition.get("lastTransitionTime"))
    return None
