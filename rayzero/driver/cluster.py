"""Which Ray cluster a run uses, and whether it can ever hold the run.

[Note: joining only when asked]
`ray.init()` without an address joins the cluster Ray last recorded in its temp directory
(`ray_current_cluster`), even when that cluster is long gone; the driver then hangs for minutes. So
rayzero joins a cluster only when asked: `RAYZERO_ADDRESS` / `RAY_ADDRESS` (set by `ray job submit`
inside a job), or a Ray this process already initialised. Otherwise it starts its own local Ray
(`address="local"`). An address that is asked for is probed first (a TCP connect to its GCS port, a
few seconds), so a gone cluster is reported at once with where its address came from.

A cluster rayzero started itself cannot autoscale, so a request its total resources can never hold
(`--workers 64` on 2 CPUs) fails at once with the numbers instead of waiting out
`placement_timeout_s`. A joined cluster may autoscale: there the driver says what is missing and
the placement timeout still applies.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rayzero.config.environment import ADDRESS
from rayzero.config.errors import RayZeroRuntimeError, RayZeroValueError
from rayzero.driver.say import say
from rayzero.driver.startup import start_retrying


class ClusterUnreachableError(RayZeroRuntimeError):
    """The Ray cluster the run was asked to join does not answer."""


class ClusterTooSmallError(RayZeroValueError):
    """The run asks for more than the whole (non-autoscaling) cluster has."""


@dataclass(frozen=True)
class Connection:
    """How this driver reached Ray."""

    started: bool
    """True when rayzero started this local Ray (it cannot autoscale)."""
    address: str | None
    """The address joined, or None for a Ray started here / already initialised."""


_TOKEN_NOTE_KEY = b"rayzero_token_note_printed"
PROBE_TIMEOUT_S = 3.0
LOCAL_START_TRIES = 3
"""Starts of the local Ray while it misses Ray's start-up bounds on a busy machine ([Note: Ray's start-up
bounds] in driver/startup.py), each retry said aloud; a missed one costs ~30 s."""


def requested_address() -> tuple[str, str] | None:
    """(address, where it came from) when the user asked to join a cluster, else None."""
    if ADDRESS.is_set():
        return ADDRESS.get().strip(), ADDRESS.name
    value = os.environ.get("RAY_ADDRESS", "").strip()  # Ray's own variable (`ray job submit` sets it)
    return (value, "RAY_ADDRESS") if value else None


def _gcs_host_port(address: str, source: str) -> tuple[str, int] | None:
    """host and port to probe for `address` (None for forms not probed: http:// job servers)."""
    if address == "auto":
        from ray._private.services import find_bootstrap_address

        recorded = find_bootstrap_address(None)
        if recorded is None:
            raise ClusterUnreachableError(
                f"{source}=auto but no Ray cluster is recorded on this machine; start one with "
                "`ray start --head`, or unset it to let rayzero start a local Ray")
        address = recorded
    if address == "local":
        return None
    if "://" in address:
        scheme, _, rest = address.partition("://")
        if scheme != "ray":
            return None
        address = rest
    host, _, port = address.rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise RayZeroValueError(f"{source}={address!r} is not host:port (e.g. 10.0.0.1:6379) nor 'auto'")
    return host.strip("[]"), int(port)


def probe(address: str, source: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise ClusterUnreachableError within `timeout_s` if nothing listens at `address`."""
    target = _gcs_host_port(address, source)
    if target is None:
        return
    host, port = target
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as error:
        raise ClusterUnreachableError(
            f"no Ray cluster answers at {host}:{port} ({source}={address}): {error.strerror or error}. "
            f"Start it (`ray start --head`), fix {source}, or unset it to let rayzero start a local Ray"
        ) from None


def connect(working_dir: str | None = None) -> Connection:
    """Join the cluster asked for, else start a local Ray (see [Note: joining only when asked]).

    `working_dir`: a directory the workers need (the CLI's target file): shipped as the job's
    runtime_env working_dir when joining a cluster from outside a Ray job.
    """
    import ray

    if ray.is_initialized():
        return Connection(started=False, address=None)
    asked = requested_address()
    if asked is not None:
        address, source = asked
        probe(address, source)
        runtime_env = None
        if working_dir and not os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
            runtime_env = {"working_dir": working_dir}
        say(f"[rayzero] joining the Ray cluster at {address} ({source})")
        with _quiet_token_warning() as token:
            ray.init(address=address, logging_level=logging.WARNING, runtime_env=runtime_env)
        _token_note_once(token.token_enabled)
        return Connection(started=False, address=address)
    print("[rayzero] starting a local Ray on this machine (set RAY_ADDRESS to join a cluster)", flush=True)

    def start() -> None:
        with _quiet_token_warning():  # a Ray of our own, gone with this process: nobody else logs in to it
            ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)

    start_retrying(start, "the local Ray", LOCAL_START_TRIES)
    return Connection(started=True, address=None)


class _TokenWarningFilter(logging.Filter):
    """Holds back Ray's per-process "Token authentication is enabled" warning; rayzero prints its note
    once per cluster instead (`_token_note_once`). Records whether Ray turned token auth on."""

    def __init__(self) -> None:
        super().__init__()
        self.token_enabled = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "Token authentication is enabled" in record.getMessage():
            self.token_enabled = True
            return False
        return True


@contextlib.contextmanager
def _quiet_token_warning() -> Iterator[_TokenWarningFilter]:
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    token_filter = _TokenWarningFilter()
    logger.addFilter(token_filter)
    try:
        yield token_filter
    finally:
        logger.removeFilter(token_filter)


def _token_note_once(token_enabled: bool) -> None:
    if not token_enabled:
        return
    from ray.experimental import internal_kv

    try:
        if internal_kv._internal_kv_exists(_TOKEN_NOTE_KEY):
            return
        internal_kv._internal_kv_put(_TOKEN_NOTE_KEY, b"1")
    except Exception:  # noqa: BLE001, S110 - the note is advice; never fail a run over it
        pass
    print("[rayzero] Ray token authentication is on for this cluster (Ray 2.60's default): `ray` CLI calls "
          "against it need RAY_AUTH_MODE=token and its token (~/.ray/auth_token); set RAY_AUTH_MODE=disabled "
          "to opt out on a loopback-only cluster (see README, 'Under ray job submit')", flush=True)


def _fits_on_node(bundle: dict[str, float], node: dict[str, float]) -> int:
    """How many copies of `bundle` a node's total resources hold."""
    counts = []
    for resource, amount in bundle.items():
        if amount <= 0:
            continue
        counts.append(math.floor(node.get(resource, 0.0) / amount + 1e-9))
    return min(counts) if counts else 1 << 30


def capacity(bundle: dict[str, float], strategy: str, nodes: list[dict[str, float]]) -> int:
    """How many bundles the nodes' totals can ever hold under the placement strategy."""
    per_node = [_fits_on_node(bundle, node) for node in nodes]
    if strategy == "STRICT_PACK":
        return max(per_node, default=0)
    if strategy == "STRICT_SPREAD":
        return sum(1 for count in per_node if count > 0)
    return sum(per_node)


def _alive_node_totals() -> list[dict[str, float]]:
    import ray

    return [dict(node.get("Resources", {})) for node in ray.nodes() if node.get("Alive")]


def check_fits(scaling: Any, connection: Connection) -> None:
    """Fail at once when a cluster rayzero started can never hold the run; warn on a joined one."""
    workers = int(getattr(scaling, "min_workers", None) or scaling.num_workers)
    bundle = scaling.bundle()
    nodes = _alive_node_totals()
    fits = capacity(bundle, scaling.placement_strategy, nodes)
    if fits >= workers:
        return
    totals: dict[str, float] = {}
    for node in nodes:
        for resource in bundle:
            totals[resource] = totals.get(resource, 0.0) + node.get(resource, 0.0)
    asked = {resource: amount * workers for resource, amount in bundle.items()}
    numbers = (f"{workers} worker(s) x {_fmt(bundle)} = {_fmt(asked)} ({scaling.placement_strategy}), but the "
               f"cluster's {len(nodes)} node(s) have {_fmt(totals)} in total, room for {fits} worker(s)")
    if connection.started:
        raise ClusterTooSmallError(
            f"the run can never start: {numbers}. rayzero started this local Ray, so nothing will be added; "
            f"ask for at most {fits} worker(s) (--workers / ScalingConfig.num_workers), fewer resources per "
            "worker, or join a larger cluster with RAY_ADDRESS")
    ceiling = _autoscaler_maximum()
    short = {key: value for key, value in asked.items() if ceiling is not None and value > ceiling.get(key, 0)}
    if short:
        raise ClusterTooSmallError(
            f"the run can never start: {numbers}, and the cluster's autoscaler can grow to at most "
            f"{_fmt({key: ceiling.get(key, 0) for key in asked})}; ask for fewer workers or resources per worker")
    say(f"[rayzero] the cluster cannot hold the run now: {numbers}; waiting up to placement_timeout_s="
          f"{scaling.placement_timeout_s:g}s for an autoscaler to add nodes")


def _autoscaler_maximum() -> dict[str, float] | None:
    """The most of each resource the cluster's autoscaler may provide, from the cluster config it
    keeps in the GCS (autoscaler v2, KubeRay); None when the cluster has no such config."""
    try:
        from ray._private.state import state

        return state.get_max_resources_from_cluster_config()
    except Exception:  # noqa: BLE001 - a private API: without it the placement timeout still applies
        return None


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{key}: {value:g}" for key, value in sorted(resources.items())) + "}"
