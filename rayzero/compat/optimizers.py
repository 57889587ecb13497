"""`deepspeed.ops.adam` / `deepspeed.ops.adagrad`: DeepSpeed's optimizer classes as torch's.

DeepSpeed's `DeepSpeedCPUAdam` and `FusedAdam` are its own kernels for Adam; Accelerate swaps a
user's torch optimizer for `DeepSpeedCPUAdam` whenever the optimizer is offloaded. The same math is
torch's fused Adam (`decoupled_weight_decay` for DeepSpeed's `adamw_mode`), which runs where rayzero's
offload backend keeps the optimizer state and which rayzero's engine takes as a tested optimizer.
Keyword defaults are DeepSpeed's (weight_decay 0, decoupled decay on), not torch's.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from rayzero.compat.refused import refuse


def _groups(params: Iterable[Any], overrides: dict[str, Any]) -> list[dict[str, Any]]:
    """Param groups with `overrides` applied to every group (a group's own `fused`/`foreach` from the
    optimizer Accelerate replaced would otherwise win over the constructor's)."""
    items = list(params)
    if items and isinstance(items[0], dict):
        return [{**group, **overrides} for group in items]
    return [{"params": items, **overrides}]


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's CPU Adam: torch's fused Adam, decoupled weight decay unless `adamw_mode=False`."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        if not bias_correction:
            refuse(f"{type(self).__name__}(bias_correction=False)",
                   "torch's Adam always corrects the moment estimates' bias")
        groups = _groups(model_params, {"decoupled_weight_decay": adamw_mode, "fused": True, "foreach": False})
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         fused=True, decoupled_weight_decay=adamw_mode)


class FusedAdam(DeepSpeedCPUAdam):
    """DeepSpeed's fused GPU Adam (`adam_w_mode` is its name for `adamw_mode`)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adamw_mode=adam_w_mode)


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's CPU Adagrad (Accelerate's stand-in for an offloaded torch Adagrad)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        super().__init__(_groups(model_params, {}), lr=lr, eps=eps, weight_decay=weight_decay)
