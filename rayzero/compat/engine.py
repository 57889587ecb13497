"""`deepspeed.initialize` and `DeepSpeedEngine`: rayzero's engine with DeepSpeed's remaining semantics.

`ZeroEngine` already carries DeepSpeed's training-step API and accessors (engine_accessors.py). What
differs for code written against DeepSpeed lives here:
- `save_checkpoint` returns once the checkpoint is committed, as DeepSpeed's does: callers (the HF
  Trainer) write their own files next to it and delete older checkpoint directories right after,
  which must never leave the newest one half written. rayzero's own API saves in the background.
- `engine.config` answers `.get(...)` / `[...]` with DeepSpeed's JSON keys (the Trainer reads
  `engine.config.get("zero_optimization", {})`), while staying the validated `RayZeroConfig`.
- what Accelerate writes into the config in-process and DeepSpeed accepts, but a JSON file could
  not hold: `steps_per_print: inf` ("never print"), translated to rayzero's "never" (absent).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from rayzero.compat.refused import refuse
from rayzero.config import RayZeroConfig
from rayzero.engine.api import initialize as _rayzero_initialize
from rayzero.engine.engine import ZeroEngine


class DeepSpeedStyleConfig(RayZeroConfig):
    """A `RayZeroConfig` that also reads as DeepSpeed's config dict (`engine.config` in DeepSpeed)."""

    @classmethod
    def of(cls, config: RayZeroConfig) -> DeepSpeedStyleConfig:
        """The same validated values, unvalidated again (they are), notes kept."""
        view = cls.model_construct(_fields_set=set(config.model_fields_set),
                                   **{name: getattr(config, name) for name in type(config).model_fields})
        view._notes = list(config.notes)
        return view

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_deepspeed_dict().get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.to_deepspeed_dict()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.to_deepspeed_dict()


class DeepSpeedEngine(ZeroEngine, torch.nn.Module):
    """rayzero's engine under DeepSpeed's class name (`isinstance(model, DeepSpeedEngine)` holds) and,
    like DeepSpeed's, a `torch.nn.Module` holding the model as its `module` child: Accelerate and the
    Trainer walk it as one (`_modules`, `named_modules`, `state_dict` keys prefixed `module.`).
    `ZeroEngine`'s methods come first (`__call__`, `train`, `parameters`, `zero_grad`, ...)."""

    def __init__(self, module: torch.nn.Module, strategy: Any, comm: Any, precision: Any, step_policy: Any,
                 loss_scaler: Any, lr_scheduler: Any, config: RayZeroConfig) -> None:
        torch.nn.Module.__init__(self)
        ZeroEngine.__init__(self, module, strategy, comm, precision, step_policy, loss_scaler, lr_scheduler,
                            DeepSpeedStyleConfig.of(config))

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.training = mode
        return ZeroEngine.train(self, mode)

    def save_checkpoint(self, save_dir: str | None = None, tag: str | None = None,
                        client_state: dict[str, Any] | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's: a sharded checkpoint in save_dir/tag, committed when this returns."""
        saved = super().save_checkpoint(save_dir, tag, client_state, save_latest, exclude_frozen_parameters,
                                        asynchronous=False)
        self.wait_for_checkpoint()
        return saved

    def load_checkpoint(self, load_dir: str | None = None, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> Any:
        return super().load_checkpoint(load_dir, tag, load_module_strict, load_optimizer_states,
                                       load_lr_scheduler_states, load_module_only, custom_load_fn)

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            frozen = {prefix + name for name, param in self.module.named_parameters() if not param.requires_grad}
            state = {name: value for name, value in state.items() if name not in frozen}
        return state

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DeepSpeed's: no gradient reduction inside. At stages 0-1 rayzero reduces only at the
        accumulation boundary anyway, so there is nothing to switch off; stages 2-3 reduce as
        gradients appear (they partition them), where DeepSpeed refuses this as well."""
        if self.zero_optimization_stage() >= 2:
            refuse(f"DeepSpeedEngine.no_sync() at ZeRO stage {self.zero_optimization_stage()}",
                   "gradient partitioning reduces every micro step, as in DeepSpeed, which refuses it too")
        yield

    def destroy(self) -> None:
        self.close()


def translate_in_process_values(config: Any) -> Any:
    """Values DeepSpeed accepts in a config dict built in-process that JSON cannot hold."""
    if isinstance(config, Mapping):
        every = config.get("steps_per_print")
        if isinstance(every, float) and math.isinf(every):
            config = {key: value for key, value in config.items() if key != "steps_per_print"}
    return config


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Any = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """`deepspeed.initialize` (0.19.8's parameters): `rayzero.initialize`, building `DeepSpeedEngine`."""
    return _rayzero_initialize(
        args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
        training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port, mpu=mpu,
        dist_init_required=dist_init_required, collate_fn=collate_fn, config=translate_in_process_values(config),
        mesh_param=mesh_param, config_params=translate_in_process_values(config_params), engine_class=DeepSpeedEngine)


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """`deepspeed.checkpoint.utils.clone_tensors_for_torch_save`: every tensor in `item` (nested
    lists, tuples, dicts) copied to `device`, so a saved state dict owns its storage. Views of one
    tensor (a tied weight under two names) stay one copy, so `save_pretrained` still sees the tie
    and writes it once, as it does for the model's own state dict (DeepSpeed's copies each name)."""
    copies: dict[tuple, torch.Tensor] = {}

    def clone(value: Any) -> Any:
        if torch.is_tensor(value):
            key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
                   value.stride(), value.dtype)
            if key not in copies:
                copies[key] = value.detach().clone().to(device)
            return copies[key]
        if isinstance(value, (list, tuple)):
            return type(value)(clone(element) for element in value)
        if isinstance(value, dict):
            return type(value)({name: clone(element) for name, element in value.items()})
        return value
    return clone(item)
