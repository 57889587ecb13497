"""The former name of `rayzero.control_api` (the control plane's protocol and client), kept so that
`rayzero.control.connect(...)` and `from rayzero.control import ControlClient` keep working.
New code imports `rayzero.control_api`."""
from __future__ import annotations

from rayzero.control_api import __all__, __getattr__  # noqa: F401  (the same lazily imported names)
