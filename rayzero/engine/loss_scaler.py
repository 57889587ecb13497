"""Loss scaling for fp16 training, with DeepSpeed's semantics.

fp16 gradients underflow to zero when the loss is small, so the loss is multiplied by a scale
before backward and the gradients are divided by it before the optimizer step. A scale that is
too large overflows instead: the step is then skipped (the parameters must not see inf/NaN) and,
for a dynamic scaler, the scale is lowered.

DeepSpeed's `fp16` config section maps onto these classes as follows:

- ``loss_scale: 0`` -> :class:`DynamicLossScaler`, ``loss_scale: S > 0`` -> ``StaticLossScaler(S)``;
- ``initial_scale_power: p`` -> the first scale is ``2**p``;
- ``loss_scale_window: W`` -> after W consecutive steps without overflow the scale doubles;
- ``hysteresis: H`` -> the scale is halved only on the H-th overflow; until then each overflow
  only spends one unit of hysteresis (the step is still skipped);
- ``consecutive_hysteresis: true`` -> a step without overflow refills the hysteresis, so only H
  overflows *in a row* lower the scale (otherwise it is refilled only when the scale grows);
- ``min_loss_scale: m`` -> the scale never goes below m.

The update rule (`DynamicLossScaler.update_scale`) reproduces DeepSpeed's
``deepspeed/runtime/fp16/loss_scaler.py`` step by step, including its stable-interval counting
(the scale grows on the W-th good step after the last overflow, counted from the iteration
after it), so a run converted from DeepSpeed sees the same scale trajectory.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from rayzero.config.errors import RayZeroRuntimeError, RayZeroValueError

# DeepSpeed's fp16 defaults (deepspeed/runtime/constants.py).
DEFAULT_INITIAL_SCALE_POWER = 16
DEFAULT_LOSS_SCALE_WINDOW = 1000
DEFAULT_HYSTERESIS = 2
DEFAULT_MIN_LOSS_SCALE = 1.0
SCALE_FACTOR = 2.0


class LossScaleAtMinimumError(RayZeroRuntimeError):
    """The gradients overflowed while the dynamic loss scale was already at its floor.

    Training cannot recover by lowering the scale further; DeepSpeed stops the run here too.
    """


def _require(condition: bool, field: str, value: Any, fix: str) -> None:
    if not condition:
        raise RayZeroValueError(f"fp16.{field}={value!r} is invalid: {fix}")


_OTHER_LOSS_SCALE = "the checkpoint was written with a different fp16.loss_scale setting (0 = dynamic)"


def _check_type(state: dict[str, Any], expected: str, scaler: str, why: str) -> None:
    """A saved scaler state loads only into a scaler of its own type."""
    if state.get("type") != expected:
        raise RayZeroValueError(
            f"loss scaler state of type {state.get('type')!r} cannot be loaded into {scaler}: {why}")


class StaticLossScaler:
    """A fixed loss scale (``fp16.loss_scale > 0``, or 1.0 for bf16/fp32).

    Overflowing steps are still skipped by the engine; the scale itself never changes.
    """

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        _require(math.isfinite(scale) and scale > 0, "loss_scale", scale, "use a positive finite number")
        self.cur_scale = float(scale)
        # Counts skipped steps so the engine can report them; not part of DeepSpeed's state.
        self.overflow_count = 0

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.cur_scale if self.cur_scale != 1.0 else loss

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.overflow_count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"type": "static", "cur_scale": self.cur_scale, "overflow_count": self.overflow_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_type(state, "static", "a static scaler", _OTHER_LOSS_SCALE)
        self.cur_scale = float(state["cur_scale"])
        self.overflow_count = int(state.get("overflow_count", 0))


class _ChangingScale:
    """What a dynamic scaler shares: the scale it multiplies the loss by."""

    dynamic = True
    cur_scale: float

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.cur_scale


class DynamicLossScaler(_ChangingScale):
    """DeepSpeed's dynamic loss scale (``fp16.loss_scale == 0``).

    Call :meth:`update_scale` once per optimizer step with whether any rank's gradients
    overflowed (the caller reduces the flag across ranks first, so all ranks stay in lockstep).
    """

    def __init__(
        self,
        init_scale: float = 2.0**DEFAULT_INITIAL_SCALE_POWER,
        scale_window: int = DEFAULT_LOSS_SCALE_WINDOW,
        min_scale: float = DEFAULT_MIN_LOSS_SCALE,
        hysteresis: int = DEFAULT_HYSTERESIS,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        _require(math.isfinite(init_scale) and init_scale > 0, "initial_scale_power", init_scale,
                 "2**initial_scale_power must be a positive finite number; use a power below 128")
        _require(int(scale_window) == scale_window and scale_window >= 1, "loss_scale_window",
                 scale_window, "use a positive integer number of steps")
        _require(math.isfinite(min_scale) and min_scale > 0, "min_loss_scale", min_scale,
                 "use a positive finite number")
        _require(int(hysteresis) == hysteresis and hysteresis >= 1, "hysteresis", hysteresis,
                 "use a positive integer (1 lowers the scale on every overflow)")
        self.cur_scale = float(init_scale)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        # DeepSpeed calls the configured hysteresis `delayed_shift`; `cur_hysteresis` is what is left.
        self.hysteresis = int(hysteresis)
        self.cur_hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        # Iteration counters drive the growth window exactly as in DeepSpeed.
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.overflow_count = 0

    def update_scale(self, overflow: bool) -> None:
        """Advance one optimizer step; ``overflow`` means that step was skipped."""
        if overflow:
            self.overflow_count += 1
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(
                        f"fp16 gradients overflowed at the minimum loss scale {self.min_scale}: the model "
                        "produces inf/NaN even unscaled. Lower the learning rate, use bf16, or lower "
                        "fp16.min_loss_scale.")
                self.cur_scale = max(self.cur_scale / SCALE_FACTOR, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.cur_scale *= SCALE_FACTOR
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "type": "dynamic",
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
            "overflow_count": self.overflow_count,
            # Settings are saved to detect, not to override, a changed config on resume.
            "scale_window": self.scale_window,
            "min_scale": self.min_scale,
            "hysteresis": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the running scale; the current config's window/floor/hysteresis settings win."""
        _check_type(state, "dynamic", "a dynamic scaler", _OTHER_LOSS_SCALE)
        self.cur_scale = max(float(state["cur_scale"]), self.min_scale)
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = min(int(state["cur_hysteresis"]), self.hysteresis)
        self.overflow_count = int(state.get("overflow_count", 0))


class GradScalerLossScaler(_ChangingScale):
    """torch.amp.GradScaler's dynamic scale with its default settings: what DeepSpeed 0.19 uses for
    `torch_autocast` in float16 ([Note: torch_autocast] in autocast.py). Starts at 2**16; an
    overflow halves it (the step is skipped); `growth_interval` steps in a row without one double it.
    No floor and no hysteresis, unlike the fp16 section's scaler."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        self.cur_scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.growth_tracker = 0  # GradScaler's _growth_tracker: steps since the last overflow or growth
        self.overflow_count = 0

    def update_scale(self, overflow: bool) -> None:
        """torch's `_amp_update_scale_` rule, once per optimizer step."""
        if overflow:
            self.overflow_count += 1
            self.cur_scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.cur_scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {"type": "grad_scaler", "cur_scale": self.cur_scale, "growth_tracker": self.growth_tracker,
                "overflow_count": self.overflow_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_type(state, "grad_scaler", "torch_autocast's float16 scaler",
                    "the checkpoint was written with another precision (fp16, torch_autocast)")
        self.cur_scale = float(state["cur_scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.overflow_count = int(state.get("overflow_count", 0))


LossScaler = StaticLossScaler | DynamicLossScaler | GradScalerLossScaler


def build_loss_scaler(fp16_config: Any | None, autocast_fp16: bool = False) -> LossScaler:
    """The scaler for a run: dynamic for ``fp16.enabled`` with ``loss_scale == 0``, else static;
    torch GradScaler's for float16 `torch_autocast` without the fp16 section (`autocast_fp16`).

    ``fp16_config`` is the config model's ``fp16`` section (or None / disabled for bf16 and fp32,
    which get a static scale of 1.0: nothing to scale). Attribute names are DeepSpeed's keys.
    """
    if fp16_config is None or not fp16_config.enabled:
        return GradScalerLossScaler() if autocast_fp16 else StaticLossScaler(1.0)
    # Every key is read from the config model: its defaults (DeepSpeed's) live in rayzero.config.
    loss_scale = float(fp16_config.loss_scale)
    if loss_scale > 0:
        return StaticLossScaler(loss_scale)
    _require(loss_scale == 0, "loss_scale", loss_scale, "use 0 for dynamic scaling or a positive scale")
    return DynamicLossScaler(
        init_scale=2.0 ** fp16_config.initial_scale_power,
        scale_window=int(fp16_config.loss_scale_window),
        min_scale=float(fp16_config.min_loss_scale),
        hysteresis=int(fp16_config.hysteresis),
        consecutive_hysteresis=bool(fp16_config.consecutive_hysteresis),
    )


def local_overflow(tensors: Iterable[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """A 0-dim float tensor, 1.0 if any tensor holds inf/NaN, else 0.0 — without a host sync.

    The caller all-reduces it with MAX across ranks (a float, because gloo cannot reduce bools)
    and reads it once, so every rank skips the same steps.
    """
    flags = [torch.logical_not(torch.isfinite(t).all()) for t in tensors if t is not None and t.numel() > 0]
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(flags).any().to(torch.float32)
