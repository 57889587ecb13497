"""The Python client of a run's control service (`rayzero.control_api.connect`).

    with rayzero.control_api.connect("exp1", storage="file:///shared/runs") as run:
        print(run.status().step)
        checkpoint = run.checkpoint_now()
        run.stop()

The address and TLS details come from the run's control.json, the token from the caller, the
environment or the controller's local token file ([Note: the control token never goes to run
storage] in tokens.py). A CA given here or in RAYZERO_CONTROL_TLS_CA is pinned: the service must
present a certificate it signed, and a run without TLS is refused rather than sent the token.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc

from rayzero.config.environment import CONTROL_TLS_CA, CONTROL_TOKEN
from rayzero.config.errors import RayZeroValueError
from rayzero.control_api import tls as control_tls
from rayzero.control_api.discovery import ControlInfo, read_control_file, run_uri
from rayzero.control_api.errors import ControlError, ControlValueError
from rayzero.control_api.tokens import find_token, read_token_file
from rayzero.control_api.v1 import control_pb2, control_pb2_grpc

DEFAULT_CALL_TIMEOUT_S = 10.0
"""Deadline of the quick calls (status, scale, kill)."""
DEFAULT_CHECKPOINT_TIMEOUT_S = 600.0
"""How long checkpoint-now and stop wait for the commit (a large model's save takes minutes)."""


class ControlClient:
    """One channel to one run's control service; every call carries the run's bearer token."""

    def __init__(self, address: str, token: str, *, tls: bool = False, root_certificates: str | None = None,
                 server_name: str | None = None, timeout_s: float = DEFAULT_CALL_TIMEOUT_S) -> None:
        """`root_certificates`: PEM CA(s) to trust (None: the system's roots); `server_name`: the name
        the service's certificate must carry, whatever `address` is ([Note: control-plane TLS])."""
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),)
        if tls:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=root_certificates.encode() if root_certificates else None)
            options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address)
        self._stub = control_pb2_grpc.ControlStub(self._channel)

    @classmethod
    def from_info(cls, info: ControlInfo, token: str, *, pinned_ca: str | None = None, **kwargs: Any
                  ) -> ControlClient:
        """A client of the service `info` describes. With `pinned_ca` (PEM) the service must use TLS
        with a certificate that CA signed; otherwise control.json's CA is trusted."""
        if pinned_ca is not None:
            if not info.tls:
                raise ControlError(f"the run at {info.address} serves its control service without TLS, but this "
                                   f"client pins a CA ({CONTROL_TLS_CA.name} / --ca-file): the token is not sent in plain "
                                   "text. Start the run with TLS, or drop the CA", "FAILED_PRECONDITION")
            pinned = control_tls.fingerprint(pinned_ca)
            if info.ca_fingerprint and info.ca_fingerprint != pinned:
                raise ControlError(f"the run at {info.address} uses the CA {info.ca_fingerprint}, not the pinned CA "
                                   f"{pinned} ({CONTROL_TLS_CA.name} / --ca-file): give this run's CA (in Kubernetes: "
                                   "`ca.crt` of the job's Secret <job>-rayzero-auth)", "FAILED_PRECONDITION")
        return cls(info.address, token, tls=info.tls, root_certificates=pinned_ca or info.root_certificates,
                   server_name=info.server_name, **kwargs)

    def _call(self, method: Any, request: Any, timeout_s: float) -> Any:
        try:
            return method(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            raise _translate(error, self.address) from None

    def status(self) -> control_pb2.Status:
        """The run's status now (see the `Status` message in control.proto)."""
        return self._call(self._stub.GetStatus, control_pb2.GetStatusRequest(), self.timeout_s)

    def watch(self, interval_s: float = 0.0) -> Iterator[control_pb2.Status]:
        """Statuses, at least one every `interval_s` (server default 0.5 s, at most 1 s), until the
        run ends: the last one has a terminal state (finished or errored)."""
        stream = self._stub.WatchStatus(control_pb2.WatchStatusRequest(interval_s=interval_s),
                                        metadata=self._metadata)
        try:
            yield from stream
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                raise _translate(error, self.address) from None
        finally:
            stream.cancel()

    def checkpoint_now(self, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S) -> control_pb2.Checkpoint:
        """Checkpoint at the next step boundary every rank reaches; returns the committed checkpoint."""
        return self._call(self._stub.CheckpointNow, control_pb2.CheckpointNowRequest(timeout_s=timeout_s),
                          timeout_s + 5)

    def stop(self, timeout_s: float = DEFAULT_CHECKPOINT_TIMEOUT_S) -> control_pb2.Checkpoint | None:
        """Planned stop: final checkpoint, then the run ends. Returns that checkpoint (None when the
        run ended before one could be taken)."""
        answer = self._call(self._stub.Stop, control_pb2.StopRequest(timeout_s=timeout_s), timeout_s + 5)
        return answer.checkpoint if answer.HasField("checkpoint") else None

    def scale(self, workers: int) -> None:
        """Resize the run to `workers` ranks (within its elastic range)."""
        self._call(self._stub.Scale, control_pb2.ScaleRequest(workers=workers), self.timeout_s)

    def kill(self, reason: str = "killed through the control service") -> None:
        """End the run now, without a checkpoint."""
        self._call(self._stub.Kill, control_pb2.KillRequest(reason=reason), self.timeout_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


_TLS_FAILURE_WORDS = ("handshake", "certificate", "verification", "ssl")
"""How gRPC's details say a connection failed in TLS (a wrong CA or name) rather than found nobody."""


def _translate(error: grpc.RpcError, address: str) -> Exception:
    code = error.code()
    detail = error.details() or ""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ControlError(f"{address} refused the call: {detail}. Use the token of this run (its "
                            "control.json, or --token-file)", code.name)
    if code == grpc.StatusCode.UNAVAILABLE and any(word in detail.lower() for word in _TLS_FAILURE_WORDS):
        return ControlError(f"TLS with {address} failed ({detail}): the service's certificate is not one the CA this "
                            "client trusts signed for the expected name. Use the run's CA (--ca-file, "
                            f"{CONTROL_TLS_CA.name}; in Kubernetes `ca.crt` of the job's Secret)", code.name)
    if code == grpc.StatusCode.UNAVAILABLE:
        return ControlError(f"no control service answers at {address} ({detail}): the run has ended or "
                            "its control.json is stale", code.name)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ControlValueError(detail, code.name)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ControlError(f"{address} did not answer in time: {detail or 'deadline exceeded'}", code.name)
    return ControlError(f"{address}: {detail or code.name}", code.name)


def status_dict(status: control_pb2.Status) -> dict[str, Any]:
    """A status as plain JSON types, every field present (what `rayzero status --json` prints)."""
    from google.protobuf.json_format import MessageToDict

    out = MessageToDict(status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for key in ("loss", "samples_per_s", "tokens_per_s", "goodput"):  # optional: null when not measured
        out.setdefault(key, None)
    for key in ("step",):  # int64 is a string in the protobuf JSON mapping; users want numbers
        out[key] = int(out[key])
    for rank in out.get("ranks", []):
        for key in ("step", "micro_step", "memory_bytes", "host_memory_bytes"):
            rank[key] = int(rank.get(key, 0))
    for checkpoint in out.get("checkpoints", []):
        checkpoint["step"] = int(checkpoint.get("step", 0))
    return out


def pinned_ca(ca_file: str | None = None) -> str | None:
    """The PEM CA to pin: `ca_file`, else the file $RAYZERO_CONTROL_TLS_CA names, else None."""
    path = ca_file or CONTROL_TLS_CA.get()
    if not path:
        return None
    try:
        with open(path) as handle:
            return control_tls.first_certificate(handle.read())
    except OSError as error:
        source = "--ca-file" if ca_file else CONTROL_TLS_CA.name
        raise RayZeroValueError(f"{source}={path!r} cannot be read ({error.strerror}); give the run's PEM CA "
                                "certificate") from None


def connect(name: str | None = None, storage: str | None = None, *, address: str | None = None,
            token: str | None = None, token_file: str | None = None, ca_file: str | None = None,
            tls: bool = False, server_name: str | None = None, **kwargs: Any) -> ControlClient:
    """A client of the live run `name` under `storage` (found through its control.json; storage
    defaults as for `rayzero run`), or of the service at `address`.

    The token: `token`, else `token_file`, else $RAYZERO_CONTROL_TOKEN, else (by name, on the
    controller's node) the run's local token file. The CA: `ca_file`, else $RAYZERO_CONTROL_TLS_CA,
    pinned; by name without either, the CA recorded in control.json."""
    ca = pinned_ca(ca_file)
    if address is None:
        if not name:
            raise RayZeroValueError("connect() needs a run name (with storage=) or address= and token/token_file")
        uri = run_uri(name, storage)
        info = read_control_file(uri, name)
        return ControlClient.from_info(info, token or find_token(uri, name, token_file), pinned_ca=ca, **kwargs)
    if token is None:
        token = read_token_file(token_file) if token_file else CONTROL_TOKEN.get()
    if not token:
        raise RayZeroValueError(f"connect(address={address!r}) needs token= or token_file= (the run's token: its "
                                f"local token file, {CONTROL_TOKEN.name}, or the job's Secret)")
    return ControlClient(address, token, tls=tls or ca is not None, root_certificates=ca, server_name=server_name,
                         **kwargs)
