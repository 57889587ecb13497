"""DeepSpeed's `deepspeed.zero` names for stage 3, so user code ports by changing the import.

    with rayzero.zero.Init(config=ds_config):      # built already partitioned
        model = MyModel()
    with rayzero.zero.GatheredParameters(model.head.weight, modifier_rank=0):
        ...                                        # full values; rank 0's edits are kept
    rayzero.zero.register_external_parameter(module, param)   # forward uses another module's param
"""
from __future__ import annotations

from rayzero.engine.stage3.gathered import GatheredParameters
from rayzero.engine.stage3.parameters import register_external_parameter
from rayzero.engine.stage3.zero_init import Init

__all__ = ["GatheredParameters", "Init", "register_external_parameter"]
