"""`deepspeed.runtime.engine` (rayzero): see rayzero/compat/engine.py."""
from rayzero.compat.engine import DeepSpeedEngine  # noqa: F401
