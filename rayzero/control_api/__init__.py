"""The API of a live run's controller: the gRPC service definition (`rayzero.v1.Control`, see
v1/control.proto), its client (`connect`, `ControlClient`, the `rayzero status|stop|scale|kill` CLI),
and what client and server share: the control file that says where a run serves (discovery.py), its
token (tokens.py) and TLS certificates (tls.py).

The server lives in the controller (`rayzero.controller.control_server`). This package imports only
`rayzero.config` from rayzero (import-linter: "the control API stands alone"), so the Kubernetes
operator uses it too. Formerly `rayzero.control` (still importable).
Names are imported on first use, so `python -m rayzero.control_api.generate` works even when the
checked-in stubs are missing or broken.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ControlClient": "rayzero.control_api.client",
    "connect": "rayzero.control_api.client",
    "status_dict": "rayzero.control_api.client",
    "ControlInfo": "rayzero.control_api.discovery",
    "read_control_file": "rayzero.control_api.discovery",
    "run_uri": "rayzero.control_api.discovery",
    "storage_root": "rayzero.control_api.discovery",
    "ControlError": "rayzero.control_api.errors",
    "ControlValueError": "rayzero.control_api.errors",
}
__all__ = ["ControlClient", "ControlError", "ControlInfo", "ControlValueError", "connect", "read_control_file",
           "run_uri", "status_dict", "storage_root"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rayzero.control_api' has no attribute {name!r}")
