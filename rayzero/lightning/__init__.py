"""Lightning on rayzero's engine: `Trainer(strategy=RayZeroStrategy(stage=3, offload_optimizer=True))`.

Needs the `lightning` extra (`pip install 'rayzero[lightning]'`). `RayZeroStrategy` takes every
keyword of Lightning's `DeepSpeedStrategy` ([Note: Lightning strategy] in strategy.py) and registers
the strategy names `rayzero`, `rayzero_stage_1`, ..., `rayzero_stage_3_offload_nvme` (DeepSpeed's
presets with its name swapped), so `Trainer(strategy="rayzero_stage_3")` works once this is imported.
"""
from __future__ import annotations

try:
    from lightning.pytorch.strategies import StrategyRegistry
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("rayzero.lightning needs Lightning: pip install 'rayzero[lightning]'") from error

from rayzero.config.lightning import LIGHTNING_PRESETS
from rayzero.lightning.callback import RayZeroCallback
from rayzero.lightning.precision import LightningSetupError, RayZeroPrecision
from rayzero.lightning.strategy import RayZeroStrategy

for _name, _preset in LIGHTNING_PRESETS.items():
    _name = _name.replace("deepspeed", RayZeroStrategy.strategy_name)
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, RayZeroStrategy, description=f"rayzero's engine with DeepSpeedStrategy's `{_name}` preset",
                                  **_preset)

__all__ = ["LightningSetupError", "RayZeroCallback", "RayZeroPrecision", "RayZeroStrategy"]
