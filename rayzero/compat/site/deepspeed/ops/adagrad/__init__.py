"""`deepspeed.ops.adagrad` (rayzero)."""
from rayzero.compat.optimizers import DeepSpeedCPUAdagrad  # noqa: F401
