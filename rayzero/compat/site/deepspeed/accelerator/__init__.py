"""`deepspeed.accelerator` (rayzero): see rayzero/compat/accelerator.py."""
from rayzero.compat.accelerator import RayZeroAccelerator, get_accelerator, set_accelerator  # noqa: F401
