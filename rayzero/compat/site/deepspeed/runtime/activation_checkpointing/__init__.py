"""`deepspeed.runtime.activation_checkpointing` (rayzero)."""
from . import checkpointing  # noqa: F401
