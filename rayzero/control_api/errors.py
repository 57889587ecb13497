"""Errors of the control client: a refused or failed call, named by its gRPC status code."""
from __future__ import annotations

from rayzero.config.errors import RayZeroRuntimeError, RayZeroValueError


class ControlError(RayZeroRuntimeError):
    """A control call failed; `code` is the gRPC status code's name (e.g. "UNAUTHENTICATED")."""

    def __init__(self, message: str, code: str = "UNKNOWN") -> None:
        super().__init__(message, code)
        self.code = code


class ControlValueError(RayZeroValueError):
    """The run refused a request's value (e.g. a worker count outside the elastic range)."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message, code)
        self.code = code
