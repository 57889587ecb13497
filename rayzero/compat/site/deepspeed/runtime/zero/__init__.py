"""`deepspeed.zero` / `deepspeed.runtime.zero` (rayzero): see rayzero/compat/zero.py."""
from rayzero.compat.zero import GatheredParameters, Init, register_external_parameter  # noqa: F401

from . import partition_parameters  # noqa: F401
