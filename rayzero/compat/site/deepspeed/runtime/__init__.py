"""`deepspeed.runtime` (rayzero)."""
from . import lr_schedules, zero  # noqa: F401
