"""`deepspeed.ops` (rayzero): DeepSpeed's optimizer classes as torch's (rayzero/compat/optimizers.py)."""
from . import adagrad, adam  # noqa: F401
