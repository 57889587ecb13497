"""rayzero.engine: ZeRO stages 0-3 over torch.distributed (never imports ray).

`initialize` (DeepSpeed's entry point), `init_distributed`, `ZeroEngine`. Imported lazily so that
`import rayzero.engine.partition` stays torch-light.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"initialize": "rayzero.engine.api", "add_config_arguments": "rayzero.engine.api",
         "init_distributed": "rayzero.engine.distributed", "ZeroEngine": "rayzero.engine.engine"}

__all__ = ["ZeroEngine", "add_config_arguments", "init_distributed", "initialize"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rayzero.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
