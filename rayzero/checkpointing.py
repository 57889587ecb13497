"""DeepSpeed's name (`deepspeed.checkpointing`) for `rayzero.activation_checkpointing`, so that code
ported from DeepSpeed runs with only the package name changed: `import rayzero.checkpointing as
checkpointing`. The same functions and settings, not a copy."""
from __future__ import annotations

from rayzero.activation_checkpointing import *  # noqa: F403
from rayzero.activation_checkpointing import __all__  # noqa: F401
