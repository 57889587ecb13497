"""torch.autocast mixed precision, as DeepSpeed 0.19's `torch_autocast` section runs it.

[Note: torch_autocast]
What DeepSpeed 0.19.8 does (runtime/torch_autocast.py, engine.py, zero/stage_1_and_2.py,
zero/stage3.py, zero/partition_parameters.py) and rayzero with it:
  - forward: the module runs under `torch.autocast(device_type, dtype)`, so torch's autocast lists
    pick each op's dtype (matmuls and convolutions in `dtype`, norms, softmax and losses in fp32);
    backward runs outside the region (autograd recorded the casts). Parameters keep their dtype:
    fp32 unless bf16/fp16 is enabled too, and then an fp32 parameter is its own master (no copy).
  - gradient communication at ZeRO stages 1-3: each parameter of a *lower-precision-safe* module
    (an exact class match: torch.nn Linear, Conv1d/2d/3d by default, or `lower_precision_safe_modules`)
    reduces its gradient in `dtype`, every other parameter in its own dtype; communication_data_type
    is not read then. Stage 0 reduces every gradient as without autocast (DeepSpeed's engine
    all-reduce does not look at the autocast dtype).
  - stage 3 all-gathers those parameters in `dtype` as well (the weight arrives rounded to `dtype`,
    which is what its autocast matmul uses anyway; a tied weight also used elsewhere sees it rounded
    there too, as in DeepSpeed). Handing the module back (`close()`) and checkpoints read the
    exact fp32 shards.
  - float16: a dynamic loss scale with torch.amp.GradScaler's settings (loss_scaler.py
    `GradScalerLossScaler`), DeepSpeed's GradScaler at every stage. Overflow is decided over all
    ranks and skips the whole step, as rayzero's fp16 does; DeepSpeed's ZeRO optimizers call the
    GradScaler per param group on each rank's own shard (so ranks or groups can skip different
    steps when only some overflow) and clip on the still-scaled norm: not reproduced.
  - an autocast region the caller opened around `engine(...)` on the compute device does not leak
    in: with `torch_autocast` the section's dtype applies, without it autocast is off inside the
    engine's forward (DeepSpeed's `autocast_if_enabled`), with a warning once.
  - refused with DeepSpeed's reason (config/runnable.py): together with zero_quantized_weights.
"""
from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rayzero.config.errors import RayZeroValueError
from rayzero.config.sections import AUTOCAST_DTYPES

DEFAULT_SAFE_MODULES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
"""DeepSpeed's LOWER_PRECISION_SAFE_MODULES."""

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class AutocastPolicy:
    """What `torch_autocast` asks of one model ([Note: torch_autocast])."""

    device_type: str
    dtype: torch.dtype
    """The lower precision autocast computes in (bf16 or fp16)."""
    lower_precision_params: frozenset[int]
    """id() of the lower-precision-safe modules' parameters: reduced (stage 3: gathered) in `dtype`."""

    def wire_dtype(self, param: torch.Tensor, own: torch.dtype) -> torch.dtype:
        """The dtype `param`'s gradient is reduced in (and, at stage 3, the parameter gathered in)
        at ZeRO stages 1-3: `dtype` for a safe module's parameter, else `own`."""
        return self.dtype if id(param) in self.lower_precision_params else own

    @property
    def scales_loss(self) -> bool:
        return self.dtype == torch.float16


def build_autocast_policy(section: Any, model: torch.nn.Module,
                          device: torch.device) -> AutocastPolicy | None:
    """The policy for the config's `torch_autocast` section, or None when it asks for no lower
    precision (absent, disabled, or dtype fp32: torch.autocast computes only in bf16/fp16)."""
    if section is None or not section.enabled:
        return None
    if section.dtype is None:
        dtype = torch.get_autocast_dtype(device.type)  # torch.autocast's own default for the device
    else:
        dtype = _DTYPES.get(AUTOCAST_DTYPES[section.dtype])
        if dtype is None:
            raise RayZeroValueError(f"torch_autocast.dtype={section.dtype!r}: autocast computes in "
                                    "bfloat16 or float16; use one of them")
    if dtype == torch.float32:
        return None
    classes = DEFAULT_SAFE_MODULES if section.lower_precision_safe_modules is None else tuple(
        _import_class(name) for name in section.lower_precision_safe_modules)
    safe = frozenset(id(param) for module in model.modules() if type(module) in classes
                     for param in module.parameters(recurse=False))
    return AutocastPolicy(device.type, dtype, safe)


def _import_class(path: str) -> type:
    where = "torch_autocast.lower_precision_safe_modules"
    module_name, _, class_name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as error:
        raise RayZeroValueError(f"{where}: cannot import {path!r} ({error}); give each module class by "
                                "its import path, e.g. \"torch.nn.Linear\"") from error
    if not (isinstance(found, type) and issubclass(found, torch.nn.Module)):
        raise RayZeroValueError(f"{where}: {path!r} is not a torch.nn.Module class")
    return found


@contextlib.contextmanager
def forward_region(policy: AutocastPolicy | None, device_type: str) -> Iterator[None]:
    """The autocast state of the engine's forward ([Note: torch_autocast])."""
    if policy is not None:
        with torch.autocast(device_type=policy.device_type, dtype=policy.dtype):
            yield
        return
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    warnings.warn(  # once per call site: warnings' default filter
        "torch.autocast is enabled around the engine's forward but the config has no torch_autocast "
        "section: autocast is off inside the engine, as in DeepSpeed (its bf16/fp16 sections set the "
        "precision). To compute under autocast, add \"torch_autocast\": {\"enabled\": true, \"dtype\": "
        "\"bfloat16\"} to the config", stacklevel=4)
    with torch.autocast(device_type=device_type, enabled=False):
        yield
