"""kopf handlers: every trigger runs the same level-triggered reconcile of one RayZeroJob.

Triggers: any event of a RayZeroJob, any event of a RayJob the operator labelled (KubeRay changed its
status), a periodic resync timer (drift, missed events) and a one-shot timer at the end of a restart
backoff. A per-job lock keeps the reconciles of one job in sequence (kopf runs sync handlers in a
thread pool and the triggers come from different watch streams); `plan` makes repeats harmless.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from rayzero.config.environment import OPERATOR_ALLOWED_HOST_PATHS, OPERATOR_CRASH_AFTER, OPERATOR_RESYNC_S
from rayzero.config.k8s_job import CONFIG_FILE_NAME, GROUP, PLURAL, VERSION
from rayzero_operator import control, manifests
from rayzero_operator.kube import KubeApi, load_client
from rayzero_operator.plan import Observed, Plan, attempt_of, attempt_state, plan
from rayzero_operator.spec import parse_allowed_host_paths, parse_spec

RESYNC_SECONDS = OPERATOR_RESYNC_S.get()
# Fault-injection seam for the k8s tests: exit hard right after the named step of a reconcile
# ("ConfigMap", "RayJob", "status") to prove a restarted operator never makes a second RayJob.
CRASH_EXIT_CODE = 86


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Keep kopf's bookkeeping in annotations under our own prefix: the status schema is ours, and
    # the structural schema would prune kopf's `status.kopf` anyway.
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    # Watch only the resources named in the handlers: scanning the cluster's CRDs would need a
    # cluster-wide `list customresourcedefinitions` the operator has no other use for.
    settings.scanning.disabled = True
    settings.posting.level = logging.WARNING  # our own Events say what happened; kopf's would repeat it
    memo.api = KubeApi(load_client())
    memo.locks = {}
    memo.requeued = set()
    memo.crash_after = OPERATOR_CRASH_AFTER.get() or ""
    # A wrong value stops the operator at start-up, naming the variable: better than guessing.
    try:
        memo.allowed_host_paths = parse_allowed_host_paths(OPERATOR_ALLOWED_HOST_PATHS.text())
    except ValueError as error:
        raise kopf.PermanentError(str(error)) from None


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The same credentials as our own client: in-cluster ServiceAccount or kubeconfig."""
    return kopf.login_via_client(**kwargs)


def _crash_point(memo: kopf.Memo, step: str) -> None:
    if memo.crash_after == step:
        logging.getLogger(__name__).error("%s=%s: exiting now", OPERATOR_CRASH_AFTER.name, step)
        os._exit(CRASH_EXIT_CODE)


def reconcile(memo: kopf.Memo, namespace: str, name: str) -> float | None:
    """Bring one RayZeroJob's RayJobs and status in line with its spec; seconds until a requeue."""
    api: KubeApi = memo.api
    lock = memo.locks.setdefault((namespace, name), threading.Lock())
    with lock:
        job = api.get_job(namespace, name)
        if job is None or job["metadata"].get("deletionTimestamp"):
            return None  # gone, or the finalizer is tearing it down: never start anything now
        text = None
        ref = ((job.get("spec") or {}).get("deepspeed") or {}).get("configMapRef")
        if isinstance(ref, dict) and isinstance(ref.get("name"), str):
            text = api.read_config_text(namespace, ref["name"], str(ref.get("key", CONFIG_FILE_NAME)))
        try:
            ray_jobs, missing = api.list_ray_jobs(namespace, name), False
        except ApiException as error:
            if error.status != 404:
                raise
            ray_jobs, missing = [], True  # no RayJob API: KubeRay is not installed (yet)
        generated = api.config_map_labels(namespace, manifests.config_map_name(name))
        credentials = ((job.get("spec") or {}).get("storage") or {}).get("credentialsSecret")
        decided = plan(Observed(
            job, ray_jobs, text, kuberay_missing=missing, generated_config_map_labels=generated,
            credentials_secret=api.secret_facts(namespace, credentials) if isinstance(credentials, str) else None,
            allowed_host_paths=memo.allowed_host_paths))
        if missing:
            decided.requeue_after = RESYNC_SECONDS
        created_ray_job = True
        for manifest in decided.create:
            made = api.create(manifest)
            if manifest["kind"] == "RayJob":
                created_ray_job = made
            _crash_point(memo, manifest["kind"])
        _talk_to_the_run(api, job, ray_jobs, decided)
        if decided.patch_ray_job is not None:
            api.patch_ray_job(namespace, *decided.patch_ray_job)
        current = {key: value for key, value in (job.get("status") or {}).items() if value is not None}
        wanted = {key: value for key, value in decided.status.items() if value is not None}
        if current != wanted:
            # A merge patch: keys we no longer report (None) are removed.
            api.patch_job_status(namespace, name, {**{key: None for key in current}, **decided.status})
            _crash_point(memo, "status")
        for kind, reason, message in decided.events:
            if reason == "RayJobCreated" and not created_ray_job:
                continue  # another reconcile created it and said so
            api.post_event(job, kind, reason, message)
        return decided.requeue_after


def _talk_to_the_run(api: KubeApi, job: dict[str, Any], ray_jobs: list[dict[str, Any]], decided: Plan) -> None:
    """Refresh the control fields of the status from the running attempt's controller and carry out
    checkpoint-now / suspend / scale through it (rayzero_operator.control); before a suspend patch."""
    spec, _ = parse_spec(job.get("spec") or {})
    latest = max(ray_jobs, key=attempt_of, default=None)
    outcome = control.Outcome(control.carried(job))
    if spec is not None and latest is not None and not decided.create:
        patch = decided.patch_ray_job
        suspending = patch is not None and patch[1]["spec"].get("suspend") is True
        running = attempt_state(latest) == "running"
        if running and (suspending or decided.status.get("phase") == "Running"):
            meta = job["metadata"]
            token, ca = api.control_credentials(meta["namespace"], meta["name"])
            outcome = control.converse(job, spec, latest, token, ca, stop_first=suspending)
            if not suspending:  # look again soon: the status follows the run while it trains
                decided.requeue_after = min(decided.requeue_after or control.REFRESH_S, control.REFRESH_S)
    decided.status.update(outcome.status)
    decided.events += outcome.events


def _reconcile_and_requeue(memo: kopf.Memo, namespace: str, name: str) -> None:
    delay = reconcile(memo, namespace, name)
    key = (namespace, name)
    if delay is not None and key not in memo.requeued:
        memo.requeued.add(key)

        def fire() -> None:
            memo.requeued.discard(key)
            try:
                _reconcile_and_requeue(memo, namespace, name)
            except Exception:  # the resync timer retries; a timer thread has nobody to raise to
                logging.getLogger(__name__).exception("requeued reconcile of %s/%s failed", namespace, name)

        timer = threading.Timer(delay + 0.05, fire)
        timer.daemon = True
        timer.start()


@kopf.on.event(GROUP, VERSION, PLURAL)
def job_changed(type: str, name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    if type != "DELETED":
        _reconcile_and_requeue(memo, namespace, name)


@kopf.on.event(manifests.RAY_GROUP, manifests.RAY_VERSION, manifests.RAY_PLURAL,
               labels={"app.kubernetes.io/managed-by": manifests.MANAGED_BY})
def ray_job_changed(labels: dict[str, str], namespace: str, memo: kopf.Memo, **_: Any) -> None:
    job_name = labels.get(manifests.LABEL_JOB)
    if job_name:
        _reconcile_and_requeue(memo, namespace, job_name)


# backoff: after a failed resync (apiserver unreachable) try again at the resync pace, not kopf's 60 s.
@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, backoff=RESYNC_SECONDS)
def resync(name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    _reconcile_and_requeue(memo, namespace, name)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def job_deleted(name: str, namespace: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """The finalizer: stop the run's Ray clusters now, then let the RayZeroJob go."""
    deleted = memo.api.delete_owned(namespace, name)
    logger.info("deleted %s", ", ".join(deleted) or "nothing")
