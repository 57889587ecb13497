"""`deepspeed.ops.adam` (rayzero)."""
from rayzero.compat.optimizers import DeepSpeedCPUAdam, FusedAdam  # noqa: F401
