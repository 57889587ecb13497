"""`optimizer.params` and `scheduler.params`, checked per `type` with DeepSpeed's parameter names.

The sections keep `params` as a dict (the set of valid keys depends on `type`); the rules validate
it against the model below for the named type, so typos get the same nearest-key suggestions.
"""
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import Field, PlainValidator, WithJsonSchema

from rayzero.config.base import (
    AUTO,
    Auto,
    AutoBool,
    AutoFloat,
    AutoInt,
    AutoNonNegativeFloat,
    AutoPositive,
    Bool,
    ConfigModel,
    Float,
)


def _betas(value: Any) -> Any:
    if isinstance(value, str) and value == AUTO:
        return AUTO
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f'expected two numbers [beta1, beta2] or "auto", got {value!r}')
    betas = []
    for beta in value:
        beta = float(beta) if isinstance(beta, (int, float, str)) and not isinstance(beta, bool) else beta
        if not isinstance(beta, float) or not 0.0 <= beta < 1.0:
            raise ValueError(f"each beta must be a number in [0, 1), got {value!r}")
        betas.append(beta)
    return betas


Betas = Annotated[
    Union[list[float], Auto],
    PlainValidator(_betas),
    WithJsonSchema({"anyOf": [{"type": "array", "items": {"type": "number"}, "minItems": 2,
                               "maxItems": 2}, {"const": AUTO}]}),
]


class AdamParams(ConfigModel):
    """Adam / AdamW (DeepSpeed's FusedAdam / CPUAdam argument names)."""

    lr: AutoNonNegativeFloat = 1e-3
    """Learning rate. "auto" = the trainer's `learning_rate`."""
    betas: Betas = Field(default_factory=lambda: [0.9, 0.999])
    """Moment decay rates. "auto" = [trainer `adam_beta1`, `adam_beta2`]."""
    eps: AutoNonNegativeFloat = 1e-8
    """Denominator term. "auto" = the trainer's `adam_epsilon`."""
    weight_decay: AutoNonNegativeFloat = 0.0
    """Weight decay (decoupled for AdamW). "auto" = the trainer's `weight_decay`."""
    bias_correction: Bool = True
    """Apply Adam's bias correction. false: DeepSpeed's kernels' uncorrected update, p -= lr·m/(√v+ε)
    (not with torch_adam, amsgrad or maximize, which DeepSpeed's kernel lacks)."""
    amsgrad: Bool = False
    """AMSGrad variant."""
    adam_w_mode: Bool = True
    """DeepSpeed: decoupled weight decay (AdamW) for type Adam; AdamW always decouples."""
    torch_adam: Bool = False
    """DeepSpeed: use torch's Adam implementation rather than a fused kernel."""
    fused: Optional[Bool] = None
    """torch.optim: use the fused implementation where available."""
    foreach: Optional[Bool] = None
    """torch.optim: use the multi-tensor implementation."""
    maximize: Bool = False
    """Maximise the objective instead of minimising it."""


class SGDParams(ConfigModel):
    """torch.optim.SGD."""

    lr: AutoNonNegativeFloat = 1e-3
    """Learning rate. "auto" = the trainer's `learning_rate`."""
    momentum: Float = Field(0.0, ge=0.0)
    """Momentum factor."""
    dampening: Float = 0.0
    """Dampening for momentum."""
    weight_decay: AutoNonNegativeFloat = 0.0
    """L2 penalty. "auto" = the trainer's `weight_decay`."""
    nesterov: Bool = False
    """Nesterov momentum."""
    maximize: Bool = False
    """Maximise the objective instead of minimising it."""
    foreach: Optional[Bool] = None
    """Use the multi-tensor implementation."""


class _SchedulerBase(ConfigModel):
    last_batch_iteration: AutoInt = -1
    """Index of the last batch when resuming (-1 = start fresh)."""


class WarmupLRParams(_SchedulerBase):
    """Warm the learning rate up from `warmup_min_lr` to `warmup_max_lr`, then hold it."""

    warmup_min_lr: AutoNonNegativeFloat = 0.0
    """Learning rate at step 0. "auto" = 0."""
    warmup_max_lr: AutoNonNegativeFloat = 0.001
    """Learning rate after warm-up. "auto" = the trainer's `learning_rate`."""
    warmup_num_steps: AutoPositive = 1000
    """Warm-up length in steps (at least 1, as DeepSpeed). "auto" = the trainer's `warmup_steps` (or
    warmup_ratio × max_steps)."""
    warmup_type: str = Field("log", pattern="^(log|linear)$")
    """Warm-up curve: `log` or `linear`."""


class WarmupDecayLRParams(WarmupLRParams):
    """WarmupLR followed by a linear decay to 0 at `total_num_steps`."""

    total_num_steps: AutoInt
    """Total training steps (required). "auto" = the trainer's `max_steps`."""


class WarmupCosineLRParams(_SchedulerBase):
    """Warm up as a ratio of the optimizer's lr, then cosine-decay."""

    total_num_steps: AutoInt
    """Total training steps (required). "auto" = the trainer's `max_steps`."""
    warmup_min_ratio: AutoNonNegativeFloat = 0.0
    """Starting lr as a fraction of the optimizer's lr."""
    warmup_num_steps: AutoPositive = 1000
    """Warm-up length in steps (at least 1, as DeepSpeed). "auto" = the trainer's `warmup_steps`."""
    cos_min_ratio: AutoNonNegativeFloat = 0.0001
    """Final lr as a fraction of the optimizer's lr."""
    warmup_type: str = Field("log", pattern="^(log|linear)$")
    """Warm-up curve: `log` or `linear`."""


class OneCycleParams(_SchedulerBase):
    """1-cycle policy (Smith 2018) with DeepSpeed's parameter names."""

    cycle_min_lr: AutoNonNegativeFloat
    """Lowest lr of the cycle (required)."""
    cycle_max_lr: AutoNonNegativeFloat
    """Highest lr of the cycle (required)."""
    decay_lr_rate: Float = 0.0
    """lr decay rate after the cycle."""
    cycle_first_step_size: AutoInt = 2000
    """Steps of the increasing half."""
    cycle_second_step_size: Optional[AutoInt] = None
    """Steps of the decreasing half (unset = same as the first)."""
    cycle_first_stair_count: AutoInt = 0
    """Stairs in the first half (0 = continuous)."""
    cycle_second_stair_count: Optional[AutoInt] = None
    """Stairs in the second half."""
    decay_step_size: AutoInt = 0
    """Steps between decays after the cycle."""
    cycle_momentum: AutoBool = True
    """Cycle momentum inversely to the lr."""
    cycle_min_mom: Float = 0.8
    """Lowest momentum."""
    cycle_max_mom: Float = 0.9
    """Highest momentum."""
    decay_mom_rate: Float = 0.0
    """Momentum decay rate after the cycle."""


class LRRangeTestParams(_SchedulerBase):
    """Increase the lr step by step to find a good range."""

    lr_range_test_min_lr: AutoNonNegativeFloat = 0.001
    """Starting lr."""
    lr_range_test_step_size: AutoInt = 2000
    """Steps per increase."""
    lr_range_test_step_rate: Float = 1.0
    """Increase per step."""
    lr_range_test_staircase: Bool = False
    """Step the lr in stairs instead of continuously."""


OPTIMIZER_PARAMS: dict[str, type[ConfigModel]] = {"adam": AdamParams, "adamw": AdamParams, "sgd": SGDParams}
"""Optimizers rayzero builds itself, by lower-case name."""
RECOGNISED_OPTIMIZERS = {
    # DeepSpeed's own optimizers: accepted, params unchecked, warned as not implemented.
    "onebitadam", "zerooneadam", "onebitlamb", "lamb", "lion", "muadam", "muadamw", "musgd",
    "adagrad", "muon",
    # torch.optim classes DeepSpeed would import by name.
    "adadelta", "adafactor", "adamax", "asgd", "lbfgs", "nadam", "radam", "rmsprop", "rprop",
    "sparseadam",
}
SCHEDULER_PARAMS: dict[str, type[ConfigModel]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}
"""DeepSpeed's schedulers (case-sensitive names, as DeepSpeed)."""
