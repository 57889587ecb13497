"""The gRPC control service of one run (`rayzero.v1.Control`), served from the controller actor.

It serves a `ControlTarget` ([Note: the control seam] in status.py): every call maps protobuf in,
calls the target, maps the answer out. What it adds is access and discovery:

- it binds the controller node's address on a free port (`RAYZERO_CONTROL_HOST` / `RAYZERO_CONTROL_PORT`
  override both; tests bind loopback);
- every call must carry `authorization: Bearer <token>` with the run's token (made per attempt,
  compared in constant time); anything else is refused with UNAUTHENTICATED before the target sees it;
- TLS when `RAYZERO_CONTROL_TLS_CERT` and `RAYZERO_CONTROL_TLS_KEY` name a PEM certificate and key
  (`RAYZERO_CONTROL_TLS_CA`: the CA clients should trust; [Note: control-plane TLS] in
  rayzero/control_api/tls.py). The Kubernetes operator always sets them. A bind beyond loopback without
  TLS logs a warning that says how to turn it on;
- `<run directory>/control.json` (address, TLS name, CA fingerprint; never the token) is written once
  the port is bound and removed at `close()`, so `rayzero status NAME` finds a live run and nothing
  else. A token the service made itself goes to a 0600 file on this node ([Note: the control token
  never goes to run storage] in rayzero/control_api/tokens.py).
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, replace
from typing import Any

import grpc

from rayzero.config.environment import (
    CONTROL_HOST,
    CONTROL_PORT,
    CONTROL_TLS_CA,
    CONTROL_TLS_CERT,
    CONTROL_TLS_KEY,
    CONTROL_TOKEN,
)
from rayzero.config.errors import RayZeroRuntimeError, RayZeroValueError
from rayzero.control_api import tls as control_tls
from rayzero.control_api.discovery import ControlInfo, remove_control_file, write_control_file
from rayzero.control_api.tokens import remove_token_file, token_path, write_token_file
from rayzero.control_api.v1 import control_pb2, control_pb2_grpc
from rayzero.controller.request_guard import MalformedRequestInterceptor
from rayzero.controller.status import CheckpointRecord, ControlTarget, RunStatus

logger = logging.getLogger(__name__)

# CONTROL_TOKEN.name: a token to use instead of a generated one (the Kubernetes operator passes the job Secret's).
WATCH_DEFAULT_INTERVAL_S, WATCH_MAX_INTERVAL_S, WATCH_MIN_INTERVAL_S = 0.5, 1.0, 0.05


def watch_interval(requested_s: float) -> float:
    """Seconds between a watch's updates: as asked, within [0.05, 1] (0: the default, 0.5)."""
    return min(max(requested_s or WATCH_DEFAULT_INTERVAL_S, WATCH_MIN_INTERVAL_S), WATCH_MAX_INTERVAL_S)
DEFAULT_WAIT_S = 600.0
TERMINAL_STATES = ("finished", "errored")


def rank_messages(status: RunStatus) -> list[control_pb2.RankStatus]:
    return [control_pb2.RankStatus(
        rank=rank.rank, node_id=rank.node_id, heartbeat_age_s=rank.heartbeat_age_s, step=rank.step,
        micro_step=rank.micro_step, memory_bytes=rank.memory_bytes,
        host_memory_bytes=rank.host_memory_bytes) for rank in status.ranks]


def status_message(status: RunStatus, ranks: list[control_pb2.RankStatus] | None = None) -> control_pb2.Status:
    """A RunStatus as the protobuf `Status` (field by field; see the note in status.py). `ranks`: its
    rank table already converted ([Note: status at scale] in status_view.py)."""
    message = control_pb2.Status(
        run_name=status.run_name, state=status.state, attempt=status.attempt, world_size=status.world_size,
        min_workers=status.min_workers, max_workers=status.max_workers, started_at=status.started_at,
        step=status.step, last_report_time=status.last_report_time,
        checkpoints=[checkpoint_message(record) for record in status.checkpoints],
        failures=status.failures, max_failures=status.max_failures, message=status.message,
        extra={str(key): str(value) for key, value in status.extra.items()},
        wall_s=status.wall_s, badput_s={str(key): float(value) for key, value in status.badput_s.items()},
        ranks=rank_messages(status) if ranks is None else ranks,
    )
    for key in ("loss", "samples_per_s", "tokens_per_s", "goodput"):  # optional fields: unset when unknown
        value = getattr(status, key)
        if value is not None:
            setattr(message, key, float(value))
    return message


def checkpoint_message(record: CheckpointRecord) -> control_pb2.Checkpoint:
    return control_pb2.Checkpoint(tier=record.tier, location=record.location, step=record.step, time=record.time)


def _wait_s(requested: float, context: grpc.ServicerContext) -> float:
    """The request's timeout, else what is left of the call's deadline, else DEFAULT_WAIT_S. NaN,
    infinite and negative timeouts are refused (INVALID_ARGUMENT); huge ones are capped at what a
    thread can wait (tests/fuzz/test_fuzz_control_service.py found both reaching the target)."""
    if not math.isfinite(requested) or requested < 0:
        raise RayZeroValueError(f"timeout_s = {requested}: give seconds >= 0 (0: until the call's deadline)")
    if requested > 0:
        return min(requested, threading.TIMEOUT_MAX)
    remaining = context.time_remaining()
    return max(0.1, remaining - 0.5) if remaining is not None else DEFAULT_WAIT_S


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """Turn the target's errors into gRPC status codes with their messages (which name the fix)."""
    def call(self: ControlServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except RayZeroValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except TimeoutError as error:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(error) or "timed out")
        except RayZeroRuntimeError as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except Exception as error:
            logger.exception("control call %s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
    call.__name__ = method.__name__
    return call


class ControlServicer(control_pb2_grpc.ControlServicer):
    """`rayzero.v1.Control` over one ControlTarget."""

    def __init__(self, target: ControlTarget) -> None:
        self._target = target
        # the newest rank table seen and its protobuf form: converted once while the target returns
        # the same table ([Note: status at scale] in status_view.py)
        self._ranks: tuple[tuple[Any, ...], list[control_pb2.RankStatus]] = ((), [])

    def _message(self, status: RunStatus) -> control_pb2.Status:
        table, converted = self._ranks
        if status.ranks is not table:
            converted = rank_messages(status)
            self._ranks = (status.ranks, converted)
        return status_message(status, converted)

    @_guarded
    def GetStatus(self, request: control_pb2.GetStatusRequest, context: grpc.ServicerContext) -> control_pb2.Status:
        return self._message(self._target.status())

    def WatchStatus(self, request: control_pb2.WatchStatusRequest, context: grpc.ServicerContext
                    ) -> Iterator[control_pb2.Status]:
        if not math.isfinite(request.interval_s) or request.interval_s < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"interval_s = {request.interval_s}: give seconds >= 0 (0: the default, "
                          f"{WATCH_DEFAULT_INTERVAL_S} s)")
        interval = watch_interval(request.interval_s)
        while context.is_active():
            try:
                status = self._target.status()
            except Exception as error:
                context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
            yield self._message(status)
            if status.state in TERMINAL_STATES:
                return
            time.sleep(interval)

    @_guarded
    def CheckpointNow(self, request: control_pb2.CheckpointNowRequest, context: grpc.ServicerContext
                      ) -> control_pb2.Checkpoint:
        return checkpoint_message(self._target.checkpoint_now(_wait_s(request.timeout_s, context)))

    @_guarded
    def Stop(self, request: control_pb2.StopRequest, context: grpc.ServicerContext) -> control_pb2.StopResponse:
        record = self._target.stop(_wait_s(request.timeout_s, context))
        return control_pb2.StopResponse(checkpoint=checkpoint_message(record) if record is not None else None)

    @_guarded
    def Scale(self, request: control_pb2.ScaleRequest, context: grpc.ServicerContext) -> control_pb2.ScaleResponse:
        self._target.scale(request.workers)
        return control_pb2.ScaleResponse()

    @_guarded
    def Kill(self, request: control_pb2.KillRequest, context: grpc.ServicerContext) -> control_pb2.KillResponse:
        self._target.kill(request.reason or "killed through the control service")
        return control_pb2.KillResponse()


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuse every call without `authorization: Bearer <the run's token>` (UNAUTHENTICATED)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode(), self._expected):
            return continuation(details)
        handler = continuation(details)
        why = "missing bearer token" if not given else "wrong bearer token"

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"{why}: send `authorization: Bearer <token>` with the run's token")

        if handler is None:
            return None
        # The refusal must have the method's own shape (unary or streaming response).
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


@dataclass(frozen=True)
class TlsFiles:
    certificate: str
    """PEM certificate chain file (the service's certificate first)."""
    private_key: str
    """PEM private key file."""
    ca: str | None = None
    """PEM file of the CA clients should trust; None: the chain's last certificate (self-signed: itself)."""

    @classmethod
    def from_env(cls) -> TlsFiles | None:
        cert, key, ca = CONTROL_TLS_CERT.get(), CONTROL_TLS_KEY.get(), CONTROL_TLS_CA.get()
        if not cert and not key:
            return None
        if not (cert and key):
            raise RayZeroValueError(f"TLS for the control service needs both {CONTROL_TLS_CERT.name} and {CONTROL_TLS_KEY.name}; "
                                    f"got {CONTROL_TLS_CERT.name}={cert!r}, {CONTROL_TLS_KEY.name}={key!r}: set both or neither")
        for variable, path in ((CONTROL_TLS_CERT.name, cert), (CONTROL_TLS_KEY.name, key), (CONTROL_TLS_CA.name, ca)):
            if path and not os.path.isfile(path):
                raise RayZeroValueError(f"{variable}={path!r} is not a file; give a PEM file readable on the "
                                        "controller's node")
        return cls(cert, key, ca or None)

    def read(self) -> tuple[bytes, bytes, str]:
        """(certificate chain, private key, CA certificate PEM)."""
        with open(self.certificate, "rb") as chain_file, open(self.private_key, "rb") as key_file:
            chain, key = chain_file.read(), key_file.read()
        if self.ca is not None:
            with open(self.ca) as ca_file:
                return chain, key, control_tls.first_certificate(ca_file.read())
        certificates = control_tls.all_certificates(chain.decode())
        if not certificates:
            raise RayZeroValueError(f"{CONTROL_TLS_CERT.name}={self.certificate!r} holds no PEM certificate")
        return chain, key, certificates[-1]


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the service on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it resolves to whatever the network says


def plaintext_warning(address: str, run_name: str) -> str:
    return (f"the control service of run {run_name!r} listens on {address} without TLS: its bearer token, which "
            "can stop or kill the run, crosses the network in plain text. Turn TLS on: `python -m "
            "rayzero.control_api.tls --out DIR`, then start the run with RAYZERO_CONTROL_TLS_CERT=DIR/tls.crt "
            "RAYZERO_CONTROL_TLS_KEY=DIR/tls.key RAYZERO_CONTROL_TLS_CA=DIR/ca.crt and give clients "
            f"RAYZERO_CONTROL_TLS_CA=DIR/ca.crt (or --ca-file); or keep it on this machine with {CONTROL_HOST.name}=127.0.0.1")


class ControlServer:
    """The gRPC server of one run: `start()` binds, serves and writes control.json; `close()` undoes it."""

    def __init__(self, target: ControlTarget, run_name: str, run_directory: str | None, *,
                 host: str | None = None, port: int | None = None, token: str | None = None,
                 tls: TlsFiles | None = None) -> None:
        self.run_name = run_name
        self.run_directory = run_directory  # URI of <storage>/<name>; None: do not write control.json
        self.host = CONTROL_HOST.get() or host or "127.0.0.1"
        self.requested_port = CONTROL_PORT.get() or port or 0  # 0: a free port
        given = token or CONTROL_TOKEN.get()
        self.token = given or secrets.token_urlsafe(32)  # made per attempt: one per controller start
        self._made_token = not given  # only a token made here goes to the local token file
        self.tls = tls if tls is not None else TlsFiles.from_env()
        self.address = ""
        self.token_file = None  # the local token file, when this server wrote one
        self._target = target
        self._server: grpc.Server | None = None
        self._wrote_file = False

    def start(self) -> ControlServer:
        # Threads: watchers hold one each for as long as they watch; a checkpoint-now call holds one
        # until the commit. Eight is many more than the callers a run has.
        # so_reuseport off: gRPC turns it on by default on Linux, and two runs sharing a fixed port
        # (RAYZERO_CONTROL_PORT) would then split each other's calls instead of failing to bind.
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="rayzero-control"),
                             interceptors=[BearerTokenInterceptor(self.token), MalformedRequestInterceptor()],
                             options=[("grpc.so_reuseport", 0)])
        control_pb2_grpc.add_ControlServicer_to_server(ControlServicer(self._target), server)
        bind = f"[{self.host}]:{self.requested_port}" if ":" in self.host else f"{self.host}:{self.requested_port}"
        info = ControlInfo(address="", run_name=self.run_name, pid=os.getpid())
        if self.tls is not None:
            chain, key, ca_pem = self.tls.read()
            credentials = grpc.ssl_server_credentials([(key, chain)])
            names = control_tls.dns_names(chain.decode())
            info = replace(info, tls=True, root_certificates=ca_pem, ca_fingerprint=control_tls.fingerprint(ca_pem),
                           server_name=names[0] if names else None)
            port = self._bind(server.add_secure_port, bind, credentials)
        else:
            port = self._bind(server.add_insecure_port, bind)
        if port == 0:
            raise RayZeroRuntimeError(f"the control service could not bind {bind}; free the port or set "
                                      f"{CONTROL_PORT.name} / {CONTROL_HOST.name} to one this node can bind")
        server.start()
        self._server = server
        self.address = bind.rsplit(":", 1)[0] + f":{port}"
        if self.tls is None and not is_loopback(self.host):
            logger.warning(plaintext_warning(self.address, self.run_name))
        if self.run_directory:
            try:
                if self._made_token:
                    self.token_file = write_token_file(token_path(self.run_directory, self.run_name), self.token)
                write_control_file(self.run_directory, replace(info, address=self.address))
                self._wrote_file = True
            except BaseException:
                self.close(grace_s=0)  # no service without its token file and control.json
                raise
        return self

    @staticmethod
    def _bind(add_port: Callable[..., int], *args: Any) -> int:
        try:
            return add_port(*args)
        except RuntimeError:  # grpc raises when the address cannot be bound (in use, not local)
            return 0

    def close(self, grace_s: float = 2.0) -> None:
        """Remove control.json (new clients stop finding the run), then stop serving: calls in flight
        (a `Stop` waiting for the run's end) get `grace_s` to answer."""
        if self._wrote_file and self.run_directory:
            try:
                remove_control_file(self.run_directory)
            except OSError as error:  # the run is over either way; a stale file only misleads clients
                logger.warning("could not remove %s/control.json: %s", self.run_directory, error)
            self._wrote_file = False
        if self.token_file is not None:
            remove_token_file(self.token_file, self.token)
            self.token_file = None
        if self._server is not None:
            self._server.stop(grace_s).wait(grace_s + 1)
            self._server = None
