"""`RayZeroPrecision`: Lightning's precision flags on rayzero's engine, as DeepSpeedStrategy maps them.

Lightning picks a precision plugin from `Trainer(precision=...)` before any strategy sees it, and
only knows DeepSpeedStrategy by name; `RayZeroStrategy` converts whatever plugin it is handed
(`as_rayzero_precision`). The mapping is DeepSpeed's (`DeepSpeedPrecision`): "32-true" trains fp32;
"bf16-mixed" / "16-mixed" add the config's `bf16` / `fp16` section, so the engine keeps 16-bit compute
weights beside fp32 masters (no autocast: the batch is cast to the compute dtype); "bf16-true" /
"16-true" also build the module in that dtype. Backward and the optimizer step are the engine's.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, get_args

import torch
from lightning.fabric.plugins.precision.deepspeed import _PRECISION_INPUT
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import WarningCache

from rayzero.config.errors import RayZeroValueError

_warnings = WarningCache()
SUPPORTED = get_args(_PRECISION_INPUT)
"""The precisions DeepSpeedStrategy accepts, and so do we."""


class LightningSetupError(RayZeroValueError, MisconfigurationException):
    """A Trainer setting RayZeroStrategy cannot honour (caught by `except RayZeroError` and by
    Lightning's own `except MisconfigurationException`)."""


class RayZeroPrecision(DeepSpeedPrecision):
    """DeepSpeedPrecision's casts, with backward and the optimizer step run by the `ZeroEngine`
    (which is `trainer.model` under RayZeroStrategy)."""

    def __init__(self, precision: str) -> None:
        if precision not in SUPPORTED:
            raise LightningSetupError(
                f"Trainer(strategy=RayZeroStrategy(), precision={precision!r}) is not supported (nor by "
                f"DeepSpeedStrategy): use one of {', '.join(SUPPORTED)}")
        super().__init__(precision)  # type: ignore[arg-type]

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        if is_overridden("backward", model):
            _warnings.warn("You have overridden `LightningModule.backward`, but RayZeroStrategy ignores it: the "
                           "engine runs backward itself (it scales the loss and reduces gradients on the way)")
        engine = model.trainer.model
        accumulate = model.trainer.accumulate_grad_batches
        if model.automatic_optimization and accumulate > 1 and not args and "scale_wrt_gas" not in kwargs:
            # [Note: accumulation scaled once] Lightning's automatic optimization has divided the loss
            # by accumulate_grad_batches already; DeepSpeedStrategy lets DeepSpeed divide it again by
            # gradient_accumulation_steps (gradients 1/k² of DDP's). Divide once, as DDP does.
            if engine.gradient_accumulation_steps() == accumulate:
                kwargs["scale_wrt_gas"] = False
            else:  # the run's config chose another accumulation (elastic): the engine divides by its own
                tensor = tensor * accumulate
        engine.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise LightningSetupError("RayZeroStrategy cannot run the LBFGS optimizer (it re-evaluates the closure "
                                      "several times per step; the engine steps once): use another optimizer")
        closure_result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and closure_result is None:
            raise LightningSetupError(
                "training_step returned None (skipping backward), which RayZeroStrategy does not support (as "
                "DeepSpeedStrategy): every rank must take part in each step's gradient reduction; return a loss")
        return model.trainer.model.step(**kwargs)


def as_rayzero_precision(plugin: Precision | None) -> RayZeroPrecision | None:
    """The RayZeroPrecision equivalent of the plugin Lightning chose from `Trainer(precision=...)`."""
    if plugin is None or isinstance(plugin, RayZeroPrecision):
        return plugin
    if type(plugin) in (Precision, MixedPrecision, HalfPrecision, DoublePrecision, DeepSpeedPrecision):
        return RayZeroPrecision(plugin.precision)
    raise LightningSetupError(
        f"RayZeroStrategy runs precision itself and cannot use the {type(plugin).__name__} plugin: remove it from "
        f"Trainer(plugins=...) and pass Trainer(precision=...) with one of {', '.join(SUPPORTED)}")
