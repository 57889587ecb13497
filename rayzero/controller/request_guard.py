"""A control-service request that does not parse is the caller's mistake, answered as one.

gRPC's Python server answers a request whose bytes are not a valid protobuf message with INTERNAL
("Exception deserializing request!"), as if the service had failed; tests/fuzz found it. This
interceptor parses the request itself and answers INVALID_ARGUMENT naming the method and the parse
error, before the service (or the run) sees anything.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class _Unparsed:
    reason: str


class MalformedRequestInterceptor(grpc.ServerInterceptor):
    """Answer INVALID_ARGUMENT to a request that does not parse (see the module docstring)."""

    def intercept_service(self, continuation: Callable[..., Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        parse, method = handler.request_deserializer, details.method

        def tolerant(data: bytes) -> Any:
            try:
                return parse(data)
            except DecodeError as error:
                return _Unparsed(str(error))

        def guarded(behaviour: Callable[..., Any]) -> Callable[..., Any]:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                if isinstance(request, _Unparsed):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"{method}: the request is not a valid message of its type ({request.reason})")
                return behaviour(request, context)
            return call

        if handler.unary_unary is not None:
            return handler._replace(request_deserializer=tolerant, unary_unary=guarded(handler.unary_unary))
        return handler._replace(request_deserializer=tolerant, unary_stream=guarded(handler.unary_stream))
