"""`deepspeed.checkpoint.utils` (rayzero)."""
from rayzero.compat.engine import clone_tensors_for_torch_save  # noqa: F401
