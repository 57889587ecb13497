"""The operator's side of the control plane: read a running job's progress from its controller and
carry out what the user asked through the RayZeroJob.

The rayzero controller of each attempt serves `rayzero.v1.Control` on the head pod
(`spec.head.controlPort`, exposed by the head Service KubeRay makes), authenticated with the job's
control token ([Note: the job's tokens] in manifests.py). On every reconcile of a running job the
operator calls `GetStatus` and copies step, loss, world size, failures and the newest checkpoint into
the RayZeroJob's status; and
- a new value of the annotation `rayzero.io/checkpoint-now` → `CheckpointNow` (once per value);
- `spec.suspend: true` on a running attempt → `Stop` (final checkpoint, then the run ends) *before*
  the RayJob is suspended, so a suspend loses no committed step;
- a new `spec.workers.replicas` within [minReplicas, maxReplicas] → `Scale` (once per value).
The service is found through the RayJob's status as KubeRay writes it: the head's service IP (else
pod IP, else service name) and the `rayzero-control` endpoint port (else `spec.head.controlPort`).
It speaks TLS with the attempt's certificate: the operator trusts only the CA in the job's Secret and
checks the job's control name (manifests.control_server_name), whatever address it dials.
When it cannot be reached, the last values stay in the status and the next reconcile tries again.
"""
from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import Any

from rayzero.config.environment import (
    CONTROL_TLS_CERT,
    OPERATOR_CHECKPOINT_TIMEOUT_S,
    OPERATOR_CONTROL_REFRESH_S,
    OPERATOR_CONTROL_TIMEOUT_S,
)
from rayzero.config.k8s_job import GROUP, RayZeroJobSpec
from rayzero.control_api import ControlClient, ControlError, ControlValueError
from rayzero_operator import manifests

logger = logging.getLogger(__name__)

CHECKPOINT_NOW_ANNOTATION = f"{GROUP}/checkpoint-now"
STATUS_KEYS = ("runState", "step", "loss", "worldSize", "failures", "goodput", "badputSeconds", "lastCheckpoint",
               "lastCheckpointStep", "controlTime", "checkpointRequest", "scaleRequest")
"""The status fields this module owns; every reconcile carries them over unless it refreshes them."""
CALL_TIMEOUT_S = OPERATOR_CONTROL_TIMEOUT_S.get()
REFRESH_S = OPERATOR_CONTROL_REFRESH_S.get()
"""Most seconds between two status refreshes of a running job. Also the least: a refresh writes the
status, which is itself an event of the job; refreshing on every event would loop."""
CHECKPOINT_TIMEOUT_S = OPERATOR_CHECKPOINT_TIMEOUT_S.get()


@dataclass
class Outcome:
    """What talking to the run gave: status fields to write and Events to post."""

    status: dict[str, Any]
    events: list[tuple[str, str, str]] = field(default_factory=list)


def carried(job: dict[str, Any]) -> dict[str, Any]:
    """The control fields of the job's current status, unchanged."""
    old = job.get("status") or {}
    return {key: old.get(key) for key in STATUS_KEYS}


def control_address(ray_job: dict[str, Any], spec: RayZeroJobSpec, namespace: str) -> str | None:
    """host:port of the attempt's control service from the RayJob's status, or None before KubeRay
    has reported the head."""
    cluster = (ray_job.get("status") or {}).get("rayClusterStatus") or {}
    head = cluster.get("head") or {}
    host = head.get("serviceIP") or head.get("podIP")
    service = head.get("serviceName") or (
        f"{ray_job['status']['rayClusterName']}-head-svc" if ray_job["status"].get("rayClusterName") else None)
    if not host and service:  # KubeRay names the head Service <cluster>-head-svc
        host = f"{service}.{namespace}.svc"
    if not host:
        return None
    port = (cluster.get("endpoints") or {}).get(manifests.CONTROL_PORT_NAME) or spec.head.control_port
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _record_checkpoint(status: dict[str, Any], checkpoint: Any) -> None:
    status["lastCheckpoint"] = checkpoint.location
    status["lastCheckpointStep"] = int(checkpoint.step)


def _apply(status: dict[str, Any], run: Any) -> None:
    status.update(runState=run.state, step=int(run.step), worldSize=run.world_size, failures=run.failures,
                  controlTime=_now())
    status["loss"] = float(run.loss) if run.HasField("loss") else None
    status["goodput"] = round(float(run.goodput), 4) if run.HasField("goodput") else None
    status["badputSeconds"] = {cause: round(float(seconds), 1) for cause, seconds in run.badput_s.items()} or None
    if run.checkpoints:
        # The durable copy outlives the cluster; otherwise the newest of any tier.
        durable = [record for record in run.checkpoints if record.tier == "durable"]
        _record_checkpoint(status, max(durable or run.checkpoints, key=lambda record: record.step))


def serves_tls(ray_job: dict[str, Any]) -> bool:
    """Whether the attempt's head was given TLS files (every RayJob this operator version makes is;
    one made before it is not, and is still spoken to in plain text until its attempt ends)."""
    head = ray_job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    return any(item.get("name") == CONTROL_TLS_CERT.name for item in head.get("env") or [])


def converse(job: dict[str, Any], spec: RayZeroJobSpec, ray_job: dict[str, Any], token: str | None,
             ca: str | None, *, stop_first: bool) -> Outcome:
    """One exchange with the attempt's controller (see the module docstring); `token` and `ca` come
    from the job's Secret."""
    meta = job["metadata"]
    outcome = Outcome(carried(job))
    address = control_address(ray_job, spec, meta["namespace"])
    tls = serves_tls(ray_job)
    if address is None or not token or (tls and not ca):
        return outcome
    old = job.get("status") or {}
    request = (meta.get("annotations") or {}).get(CHECKPOINT_NOW_ANNOTATION)
    checkpoint_pending = bool(request) and request != old.get("checkpointRequest")
    if not (stop_first or checkpoint_pending or _scale_wanted(spec, ray_job, old) or _refresh_due(old)):
        return outcome
    try:
        with ControlClient(address, token, tls=tls, root_certificates=ca, timeout_s=CALL_TIMEOUT_S,
                           server_name=manifests.control_server_name(meta["name"], meta["namespace"])) as client:
            if stop_first:
                checkpoint = client.stop(CHECKPOINT_TIMEOUT_S)
                if checkpoint is not None:
                    _record_checkpoint(outcome.status, checkpoint)
                    text = f"committed a final checkpoint at step {checkpoint.step} ({checkpoint.location})"
                else:
                    text = "the run ended before a final checkpoint could be taken"
                outcome.status.update(runState="finished", controlTime=_now())
                outcome.events.append(("Normal", "StoppedForSuspend", f"stopped the run for spec.suspend: {text}"))
                return outcome
            run = client.status()
            _apply(outcome.status, run)
            if checkpoint_pending:
                try:
                    checkpoint = client.checkpoint_now(CHECKPOINT_TIMEOUT_S)
                except ControlError as error:
                    if error.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                        raise  # not carried out: try again on the next reconcile
                    outcome.status["checkpointRequest"] = request
                    outcome.events.append(("Warning", "CheckpointRefused", f"{CHECKPOINT_NOW_ANNOTATION}="
                                           f"{request}: {error}"))
                else:
                    outcome.status["checkpointRequest"] = request
                    _record_checkpoint(outcome.status, checkpoint)
                    outcome.events.append(("Normal", "CheckpointCommitted", f"{CHECKPOINT_NOW_ANNOTATION}={request}: "
                                           f"committed step {checkpoint.step} at {checkpoint.location}"))
            _scale(client, spec, ray_job, old, run, outcome)
    except ControlError as error:
        logger.info("control service of %s/%s at %s: %s", meta["namespace"], meta["name"], address, error)
    return outcome


def _refresh_due(old: dict[str, Any]) -> bool:
    stamp = old.get("controlTime")
    if not stamp:
        return True
    then = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    return (dt.datetime.now(dt.timezone.utc) - then).total_seconds() >= REFRESH_S


def _scale_wanted(spec: RayZeroJobSpec, ray_job: dict[str, Any], old: dict[str, Any]) -> int | None:
    """The world size to ask for: spec.workers changed since the attempt started and not yet asked."""
    started_with = ray_job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].get("replicas")
    if spec.workers.replicas == started_with and old.get("scaleRequest") is None:
        return None  # never scaled: the run's own elastic shrink/grow is the controller's business
    wanted = spec.world_size()
    return None if wanted == old.get("scaleRequest") else wanted


def _scale(client: ControlClient, spec: RayZeroJobSpec, ray_job: dict[str, Any], old: dict[str, Any], run: Any,
           outcome: Outcome) -> None:
    """Ask for spec.workers when the user changed it since the attempt started (once per value)."""
    wanted = _scale_wanted(spec, ray_job, old)
    if wanted is None or wanted == run.world_size:
        return
    try:
        client.scale(wanted)
    except ControlValueError as error:
        outcome.status["scaleRequest"] = wanted  # refused for good: not asked again for this value
        outcome.events.append(("Warning", "ScaleRefused", f"spec.workers.replicas={spec.workers.replicas}: {error}"))
        return
    outcome.status["scaleRequest"] = wanted
    outcome.events.append(("Normal", "Scaling", f"asked the run to resize from {run.world_size} to {wanted} "
                           "workers (checkpoint, regroup, resume)"))
