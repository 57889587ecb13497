"""DeepSpeed names rayzero does not implement: each raises one clear error when used.

A refused name is still importable (`from deepspeed.utils import groups` must not break a module
that only uses it on a path rayzero never takes); it fails when called or read, naming the DeepSpeed
name, why rayzero has no counterpart, and what to do instead.
"""
from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, NoReturn

from rayzero.config.errors import RayZeroValueError


class DeepSpeedNameRefused(RayZeroValueError):
    """A DeepSpeed API that rayzero's compatibility layer does not map (see docs/deepspeed-api.md)."""


def refuse(name: str, reason: str) -> NoReturn:
    raise DeepSpeedNameRefused(
        f"{name} is not supported on rayzero: {reason}. See docs/deepspeed-api.md for what each DeepSpeed "
        "name maps to")


def refused(name: str, reason: str) -> Callable[..., NoReturn]:
    """A stand-in for a DeepSpeed callable or class that raises when called."""

    def stand_in(*args: Any, **kwargs: Any) -> NoReturn:
        refuse(name, reason)
    stand_in.__name__ = stand_in.__qualname__ = name.rsplit(".", 1)[-1]
    stand_in.__doc__ = f"Refused by rayzero: {reason}."
    return stand_in


class RefusedModule(types.ModuleType):
    """A stand-in for a DeepSpeed module: importable, every attribute read raises."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(name, f"Refused by rayzero: {reason}.")
        self._reason = reason

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        refuse(f"{self.__name__}.{attribute}", self._reason)


PARALLELISM = ("rayzero trains data parallel only (ZeRO shards across every rank); tensor, pipeline, "
               "sequence and expert parallelism are not implemented")
INFERENCE = "rayzero is a training engine; DeepSpeed's inference engine and kernels are not included"
