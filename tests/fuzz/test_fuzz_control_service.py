"""Fuzz the gRPC control service (`rayzero.v1.Control`) over a real server and the in-process run of
tests/testkit/control_fake_run.py: sequences of calls with out-of-range values (NaN, infinities,
negative and huge timeouts and intervals, any int32 worker count, any reason text), raw bytes that
are not a valid request, and missing or wrong tokens. Property: each call answers (OK or a status
other than UNKNOWN/INTERNAL, with details), before the client's deadline: no hang.

Regressions (the @example lines): a NaN `interval_s` made WatchStatus raise in time.sleep, an infinite
or huge `timeout_s` reached the run's wait and overflowed (both INTERNAL, now INVALID_ARGUMENT / a capped
wait), and bytes that do not parse got gRPC's INTERNAL (now INVALID_ARGUMENT, request_guard.py)."""
from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import examples
from testkit.control_fake_run import FakeRun

from rayzero.control_api.v1 import control_pb2
from rayzero.controller.control_server import ControlServer

DEADLINE_S = 20.0
TIMES = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                  st.sampled_from([0.0, -1.0, 1e-300, 1e300, float("inf"), float("-inf"), float("nan"), 2.0**63]))
CALLS = st.one_of(
    st.tuples(st.just("GetStatus"), st.builds(control_pb2.GetStatusRequest)),
    st.tuples(st.just("WatchStatus"), st.builds(control_pb2.WatchStatusRequest, interval_s=TIMES)),
    st.tuples(st.just("CheckpointNow"), st.builds(control_pb2.CheckpointNowRequest, timeout_s=TIMES)),
    st.tuples(st.just("Stop"), st.builds(control_pb2.StopRequest, timeout_s=TIMES)),
    st.tuples(st.just("Scale"), st.builds(control_pb2.ScaleRequest, workers=st.integers(-(2**31), 2**31 - 1))),
    st.tuples(st.just("Kill"), st.builds(control_pb2.KillRequest, reason=st.text(max_size=64))),
    st.tuples(st.sampled_from(["GetStatus", "CheckpointNow", "Scale", "Stop"]), st.binary(max_size=32)),
)
TOKENS = st.sampled_from(["right", "right", "right", "wrong", "missing"])
BAD_CODES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)


def _call(channel: grpc.Channel, method: str, request, metadata) -> None:
    path = f"/rayzero.v1.Control/{method}"
    raw = isinstance(request, bytes)
    serialize = (lambda value: value) if raw else type(request).SerializeToString
    if method == "WatchStatus":
        stream = channel.unary_stream(path, request_serializer=serialize,
                                      response_deserializer=control_pb2.Status.FromString)
        responses = stream(request, metadata=metadata, timeout=DEADLINE_S)
        for count, _ in enumerate(responses):
            if count == 2:
                responses.cancel()
                break
        return
    unary = channel.unary_unary(path, request_serializer=serialize, response_deserializer=lambda data: data)
    unary(request, metadata=metadata, timeout=DEADLINE_S)


@pytest.fixture
def make_server(monkeypatch):
    monkeypatch.setenv("RAYZERO_CONTROL_HOST", "127.0.0.1")
    made = []

    def make():
        run = FakeRun("fuzz", "/nonexistent/checkpoints-are-not-written", step_s=0.02)
        server = ControlServer(run, "fuzz", None).start()
        made.append((run, server))
        return run, server

    yield make
    for run, server in made:
        run.kill("test over")
        server.close(grace_s=0.2)


@examples(40)
@given(calls=st.lists(st.tuples(CALLS, TOKENS), min_size=1, max_size=4))
@example(calls=[(("WatchStatus", control_pb2.WatchStatusRequest(interval_s=math.nan)), "right")])
@example(calls=[(("CheckpointNow", control_pb2.CheckpointNowRequest(timeout_s=math.inf)), "right")])
@example(calls=[(("CheckpointNow", control_pb2.CheckpointNowRequest(timeout_s=1e300)), "right")])
@example(calls=[(("GetStatus", b"\x00" * 15), "right")])
def test_calls_answer_with_a_meaningful_status(make_server, calls):
    _run, server = make_server()
    with grpc.insecure_channel(server.address) as channel:
        for (method, request), token in calls:
            metadata = {"right": [("authorization", f"Bearer {server.token}")],
                        "wrong": [("authorization", "Bearer nope")], "missing": []}[token]
            try:
                _call(channel, method, request, metadata)
            except grpc.RpcError as error:
                code, details = error.code(), error.details() or ""
                assert code not in BAD_CODES, (method, request, code, details)
                assert not (code == grpc.StatusCode.DEADLINE_EXCEEDED and details == "Deadline Exceeded"), \
                    f"{method} hung past the client's {DEADLINE_S}s deadline"
                assert details, (method, code)
                if token != "right":
                    assert code == grpc.StatusCode.UNAUTHENTICATED
