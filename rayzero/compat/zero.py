"""`deepspeed.zero`: `Init`, `GatheredParameters`, `register_external_parameter` on rayzero's stage 3.

`Init` is `rayzero.zero.Init` ([Note: partitioned construction]) with DeepSpeed's signature, plus
one case DeepSpeed's Init leaves to its caller: a Hugging Face model that transformers builds under
its own ZeRO-3 path (`from_pretrained` / `from_config` with `is_deepspeed_zero3_enabled()`).
transformers enters `Init` inside `no_init_weights()` (every init function a no-op) and marks the
build with `set_zero3_state()`; once the context exits it initialises the weights itself, gathered
on rank 0 (`initialize_weights_zero3`), or loads them (`_load_state_dict_into_zero3_model`). The
partitions built here then start from zeros and take transformers' values, as under DeepSpeed
(where they start from whatever memory held). Any other model is initialised as rayzero.zero.Init
does: the constructors' (or `_init_weights`') values, identical to an unpartitioned build.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from rayzero.compat.refused import PARALLELISM, refuse
from rayzero.engine.stage3.gathered import GatheredParameters as _RayZeroGatheredParameters
from rayzero.engine.stage3.parameters import register_external_parameter
from rayzero.engine.stage3.zero_init import Init as _RayZeroInit


def _transformers_is_building() -> bool:
    """Inside transformers' ZeRO-3 model build (its `set_zero3_state()` context)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return bool(getattr(modeling, "_is_ds_init_called", False))


def _zero_own_parameters(module: torch.nn.Module) -> None:
    for param in module.parameters(recurse=False):
        param.zero_()


class Init(_RayZeroInit):
    """DeepSpeed's `zero.Init` keywords; see the module docstring for who initialises the values."""

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Any = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, zero_param_parallel_group: Any = None,
                 zero_quantized_weights: bool = False, zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None, **kwargs: Any) -> None:
        for name, value in (("mpu", mpu), ("zero_param_parallel_group", zero_param_parallel_group),
                            ("sequence_data_parallel_group", sequence_data_parallel_group)):
            if value is not None:
                refuse(f"deepspeed.zero.Init({name}=...)", PARALLELISM)
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            refuse("deepspeed.zero.Init(zero_quantized_weights=True)", "ZeRO++ weight quantization is not implemented")
        self._transformers_initializes: bool | None = None  # decided when the first parameter appears
        super().__init__(module=module, data_parallel_group=data_parallel_group,
                         config_dict_or_path=config_dict_or_path, config=config, enabled=enabled,
                         remote_device=remote_device, pin_memory=pin_memory, dtype=dtype)

    def _on_parameter(self, module: torch.nn.Module, name: str, param: Any) -> Any:
        if self._transformers_initializes is None:
            self._transformers_initializes = _transformers_is_building()
        return super()._on_parameter(module, name, param)

    def _materialize(self) -> None:
        if self._transformers_initializes and self.param_init_fn is None:
            self.param_init_fn = _zero_own_parameters
        super()._materialize()


class GatheredParameters(_RayZeroGatheredParameters):
    """`deepspeed.zero.GatheredParameters`: as rayzero's, and like DeepSpeed's it skips `None` in
    `params` (transformers passes `[lm_head.weight, lm_head.bias]` whether the bias exists or not)."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: torch.nn.Module | None = None,
                 enabled: bool = True) -> None:
        if params is None:
            params = []
        elif not isinstance(params, torch.Tensor):
            params = [param for param in params if param is not None]
        super().__init__(params, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled)


def _unwrapped_tensor_constructor(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's Init wraps torch's tensor factories to change their device and dtype; rayzero's
    does not (only parameters are redirected, through a registration hook). transformers swaps this
    name out and back in (`prevent_arange_dtype_change`), so it exists, and is never called here."""
    return fn


__all__ = ["GatheredParameters", "Init", "register_external_parameter"]
