"""The client side of rayzero's control plane (`rayzero.v1.Control`, see v1/control.proto).

Imports only `rayzero.config` from rayzero (import-linter: "control stands alone"), so the
Kubernetes operator uses it too. The server lives in `rayzero.controller.control_server`.
Names are imported on first use, so `python -m rayzero.control.generate` works even when the
checked-in stubs are missing or broken.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ControlClient": "rayzero.control.client",
    "connect": "rayzero.control.client",
    "status_dict": "rayzero.control.client",
    "ControlInfo": "rayzero.control.discovery",
    "read_control_file": "rayzero.control.discovery",
    "run_uri": "rayzero.control.discovery",
    "storage_root": "rayzero.control.discovery",
    "ControlError": "rayzero.control.errors",
    "ControlValueError": "rayzero.control.errors",
}
__all__ = ["ControlClient", "ControlError", "ControlInfo", "ControlValueError", "connect", "read_control_file",
           "run_uri", "status_dict", "storage_root"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rayzero.control' has no attribute {name!r}")
