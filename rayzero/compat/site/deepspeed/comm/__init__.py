"""`deepspeed.comm` (rayzero): see rayzero/compat/comm.py."""
from rayzero.compat.comm import *
from rayzero.compat.comm import __getattr__  # noqa: F401  (other torch.distributed names)
