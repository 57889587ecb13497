"""The Python client of a run's control service (`rayzero.control.connect`).

    with rayzero.control.connect("exp1", storage="file:///shared/runs") as run:
        print(run.status().step)
        checkpoint = run.checkpoint_now()
        run.stop()
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from rayzero.config.errors import RayZeroValueError
from rayzero.control.discovery import ControlInfo, read_control_file, run_uri
from rayzero.control.errors import ControlError, ControlValueError
from rayzero.control.v1 import control_pb2, control_pb2_grpc

DEFAULT_CALL_TIMEOUT_S = 10.0
"""Deadline of the quick calls (status, scale, kill)."""
DEFAULT_CHECKPOINT_TIMEOUT_S = 600.0
"""How long checkpoint-now and stop wait for the commit (a large model's save takes minutes)."""


class ControlClient:
    """One channel to one run's control service; every call carries the run's bearer token."""

    def __init__(self, address: str, token: str, *, tls: bool = False, root_certificates: str | None = None,
                 timeout_s: float = DEFAULT_CALL_TIMEOUT_S) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),)
        if tls:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=root_certificates.encode() if root_certificates else None)
            self._channel = grpc.secure_channel(address, credentials)
        else:
            self._channel = grpc.insecure_channel(address)
        self._stub = control_pb2_grpc.ControlStub(self._channel)

    @classmethod
    def from_info(cls, info: ControlInfo, **kwargs: Any) -> ControlClient:
        return cls(info.address, info.token, tls=info.tls, root_certificates=info.root_certificates, **kwargs)

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


def _translate(error: grpc.RpcError, address: str) -> Exception:
    code = error.code()
    detail = error.details() or ""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ControlError(f"{address} refused the call: {detail}. Use the token of this run (its "
                            "control.json, or --token-file)", code.name)
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
    for key in ("loss", "samples_per_s", "tokens_per_s"):  # optional: null when the run never reported it
        out.setdefault(key, None)
    for key in ("step",):  # int64 is a string in the protobuf JSON mapping; users want numbers
        out[key] = int(out[key])
    for rank in out.get("ranks", []):
        for key in ("step", "micro_step", "memory_bytes", "host_memory_bytes"):
            rank[key] = int(rank.get(key, 0))
    for checkpoint in out.get("checkpoints", []):
        checkpoint["step"] = int(checkpoint.get("step", 0))
    return out


def connect(name: str | None = None, storage: str | None = None, *, address: str | None = None,
            token: str | None = None, token_file: str | None = None, **kwargs: Any) -> ControlClient:
    """A client of the live run `name` under `storage` (found through its control.json; storage
    defaults as for `rayzero run`), or of the service at `address` with `token` / `token_file`."""
    if address is None:
        if not name:
            raise RayZeroValueError("connect() needs a run name (with storage=) or address= and token/token_file")
        return ControlClient.from_info(read_control_file(run_uri(name, storage), name), **kwargs)
    if token is None and token_file is not None:
        token = Path(token_file).read_text().strip()
    if not token:
        raise RayZeroValueError(f"connect(address={address!r}) needs token= or token_file= (the run's token, "
                                "from its control.json or the job's Secret)")
    return ControlClient(address, token, **kwargs)
