"""DeepSpeed's five learning-rate schedules as torch ``LRScheduler`` subclasses.

The formulas and parameter names are DeepSpeed's (``deepspeed/runtime/lr_schedules.py``) so a
``"scheduler": {"type": ..., "params": {...}}`` section trains the same way here. Being real
``LRScheduler`` subclasses, they work with torch tooling (``get_last_lr``, ``state_dict``).

[Note: scheduler iteration numbering]
DeepSpeed counts ``last_batch_iteration`` from -1: the constructor applies the lr for iteration
-1 and every ``step()`` (called after each *applied* optimizer step) advances it by one. torch's
``LRScheduler`` instead performs an initial ``step()`` in its constructor that moves
``last_epoch`` from -1 to 0. So here ``last_batch_iteration == last_epoch - 1`` always, and every
formula below reads ``last_batch_iteration``; the optimizer therefore sees exactly DeepSpeed's
lr sequence. The engine must not step the scheduler on a step skipped for fp16 overflow
(DeepSpeed does not either).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from rayzero.config.errors import RayZeroValueError

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"


def _per_group(optimizer: Optimizer, value: float | Sequence[float], name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise RayZeroValueError(
                f"scheduler.params.{name} has {len(value)} values but the optimizer has "
                f"{len(optimizer.param_groups)} param groups: give one value, or one per group")
        return [float(v) for v in value]
    return [float(value)] * len(optimizer.param_groups)


class _DeepSpeedSchedule(LRScheduler):
    """Shared plumbing: DeepSpeed's iteration numbering on top of torch's ``last_epoch``."""

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int = -1) -> None:
        # torch requires `initial_lr` in each group when resuming with last_epoch >= 0.
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's name for the index of the last batch (see [Note: scheduler iteration numbering])."""
        return self.last_epoch - 1

    def _momenta(self) -> list[float] | None:
        """First momentum coefficient per group at this iteration, or None to leave it alone."""
        return None

    def step(self, last_batch_iteration: int | None = None) -> None:  # type: ignore[override]
        """Advance one batch, or jump to ``last_batch_iteration`` as DeepSpeed's ``step`` allows."""
        self._step_count = getattr(self, "_step_count", 0) + 1
        self.last_epoch = self.last_epoch + 1 if last_batch_iteration is None else last_batch_iteration + 1
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if hasattr(group["lr"], "fill_"):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        momenta = self._momenta()
        if momenta is not None:
            for group, momentum in zip(self.optimizer.param_groups, momenta):
                if "betas" in group:
                    group["betas"] = (momentum, group["betas"][1])
                else:
                    group["momentum"] = momentum
        self._last_lr = [float(group["lr"]) for group in self.optimizer.param_groups]


class WarmupLR(_DeepSpeedSchedule):
    """Rise from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    ``warmup_type`` ``"log"``: lr = min + (max - min) * ln(i + 1) / ln(N);
    ``"linear"``: lr = min + (max - min) * i / N, where i is the batch iteration.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        if int(warmup_num_steps) != warmup_num_steps or warmup_num_steps <= 0:
            raise RayZeroValueError(f"scheduler.params.warmup_num_steps={warmup_num_steps!r}: use a positive integer")
        if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
            raise RayZeroValueError(f"scheduler.params.warmup_type={warmup_type!r}: use 'log' or 'linear'")
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [high - low for high, low in zip(self.max_lrs, self.min_lrs)]
        # DeepSpeed floors the step count at 2 so that ln(N) is never 0.
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)

    def _warmup_gamma(self, iteration: int) -> float:
        if self.warmup_type == WARMUP_LOG_RATE:
            return self.inverse_log_warm_up * math.log(iteration + 1)
        return iteration / self.warmup_num_steps

    def _gamma(self, iteration: int) -> float:
        return self._warmup_gamma(iteration) if iteration < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:  # type: ignore[override]
        iteration = self.last_batch_iteration
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``:
    lr = min + (max - min) * max(0, (T - i) / max(1, T - N))."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        if int(total_num_steps) != total_num_steps or total_num_steps <= 0:
            raise RayZeroValueError(f"scheduler.params.total_num_steps={total_num_steps!r}: use a positive integer")
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self._warmup_gamma(iteration)
        remaining = float(self.total_num_steps - iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_DeepSpeedSchedule):
    """Warm up from ``warmup_min_ratio`` × the optimizer's lr to its full lr over
    ``warmup_num_steps``, then cosine-decay to ``cos_min_ratio`` × lr at ``total_num_steps`` and hold.

    Ratios are of each group's lr when the schedule is built (DeepSpeed's ``org_lrs``):
    warm-up ratio = min + (1 - min) * (ln(i + 1) / ln(N) for ``log``, i / N for ``linear``);
    after it, ratio = max(0, c + (1 - c) * (1 + cos(pi * min(1, (i - N + 1) / max(1, T - N)))) / 2).
    Before the first step (iteration -1) the lr is 0, as in DeepSpeed.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        if int(warmup_num_steps) != warmup_num_steps or warmup_num_steps <= 0:
            raise RayZeroValueError(f"scheduler.params.warmup_num_steps={warmup_num_steps!r}: use a positive integer")
        if int(total_num_steps) != total_num_steps or total_num_steps <= 0:
            raise RayZeroValueError(f"scheduler.params.total_num_steps={total_num_steps!r}: use a positive integer")
        if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
            raise RayZeroValueError(f"scheduler.params.warmup_type={warmup_type!r}: use 'log' or 'linear'")
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = warmup_type
        # DeepSpeed floors the step count at 2 so that ln(N) is never 0.
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)
        # The base lrs (torch's initial_lr, set by the base class) are DeepSpeed's org_lrs.
        self.org_lrs = [float(group["initial_lr"]) for group in optimizer.param_groups]

    def _ratio(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            if self.warmup_type == WARMUP_LOG_RATE:
                ratio = self.inverse_log_warm_up * math.log(iteration + 1)
            else:
                ratio = iteration / self.warmup_num_steps
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        iteration = self.last_batch_iteration
        bases = [float(group["initial_lr"]) for group in self.optimizer.param_groups]
        if iteration < 0:
            return [0.0 for _ in bases]
        ratio = self._ratio(iteration)
        return [base * ratio for base in bases]


class OneCycle(_DeepSpeedSchedule):
    """1Cycle: lr rises min→max over ``cycle_first_step_size`` batches, falls back over
    ``cycle_second_step_size``, then decays as ``min / (1 + decay_lr_rate * k / decay_step_size)``.
    Momentum (``betas[0]``, or SGD's ``momentum``) moves inversely between ``cycle_max_mom`` and
    ``cycle_min_mom`` and grows by ``(1 + decay_mom_rate * k / decay_step_size)`` after the cycle.

    Stair counts hold lr/momentum flat in that many stairs per half cycle (0 = continuous).
    One deliberate difference from DeepSpeed: it overwrites ``betas[1]`` with 0.99; this keeps the
    optimizer's own second beta, which the user chose.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        if cycle_first_step_size <= 0:
            raise RayZeroValueError(f"scheduler.params.cycle_first_step_size={cycle_first_step_size!r}: use a positive integer")
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (float(cycle_second_step_size) if cycle_second_step_size is not None
                                 else self.first_step_size)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = int(cycle_first_stair_count)
        self.second_stair_count = (self.first_stair_count if cycle_second_stair_count is None
                                   else int(cycle_second_stair_count))
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)
        group0 = optimizer.param_groups[0] if optimizer.param_groups else {}
        # Optimizers without a momentum coefficient (Adagrad, plain SGD) cannot cycle it.
        self.cycle_momentum = bool(cycle_momentum) and ("betas" in group0 or group0.get("momentum", 0) > 0)
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)
        super().__init__(optimizer, last_batch_iteration)

    def _scale_factor(self) -> float:
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stair_count = x / self.step_ratio, self.first_stair_count
        else:
            scale, stair_count = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stair_count > 0:
            # Quantise from the integer offset, not from `scale`: the float scale at a half-cycle
            # boundary can land just under an exact stair and floor a whole stair too low.
            in_cycle = batch_iteration % self.total_size
            if in_cycle <= self.first_step_size:
                position = in_cycle * stair_count / self.first_step_size
            else:
                position = (self.total_size - in_cycle) * stair_count / self.second_step_size
            scale = math.floor(position) / stair_count
        return scale

    def get_lr(self) -> list[float]:  # type: ignore[override]
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        decay_iteration = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_lr_rate * decay_iteration / self.decay_step_size
        return [low / factor for low in self.min_lrs]

    def _momenta(self) -> list[float] | None:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < 0:
            # DeepSpeed's constructor starts momentum at cycle_min_mom (not at the formula's
            # cycle_max_mom for iteration 0); the first optimizer step sees that value.
            return list(self.min_moms)
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [high - (high - low) * scale for low, high in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        decay_iteration = self.last_batch_iteration - self.total_size + 1
        factor = 1 + self.decay_mom_rate * decay_iteration / self.decay_step_size
        return [high * factor for high in self.max_moms]


class LRRangeTest(_DeepSpeedSchedule):
    """lr = min_lr * (1 + step_rate * (i + 1) / step_size), floored per stair when staircase."""

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        if lr_range_test_step_size <= 0:
            raise RayZeroValueError(
                f"scheduler.params.lr_range_test_step_size={lr_range_test_step_size!r}: use a positive integer")
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer, last_batch_iteration)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        interval = float(self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [low * (1 + self.step_rate * interval) for low in self.min_lrs]


SCHEDULERS: dict[str, type[_DeepSpeedSchedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}


def build_scheduler(scheduler_config: Any | None, optimizer: Optimizer) -> LRScheduler | None:
    """The schedule named by the config's ``scheduler.type`` with ``scheduler.params``, or None.

    ``scheduler_config`` is the config model's ``scheduler`` section (``.type``, ``.params``) or
    a plain ``{"type": ..., "params": ...}`` dict.
    """
    if scheduler_config is None:
        return None
    if isinstance(scheduler_config, dict):
        kind, params = scheduler_config.get("type"), scheduler_config.get("params") or {}
    else:
        kind, params = getattr(scheduler_config, "type", None), getattr(scheduler_config, "params", None) or {}
    if kind is None:
        return None
    if hasattr(params, "model_dump"):
        params = params.model_dump(exclude_none=True)
    schedule = SCHEDULERS.get(kind)
    if schedule is None:
        raise RayZeroValueError(f"scheduler.type={kind!r} is not supported: use one of {sorted(SCHEDULERS)}")
    try:
        return schedule(optimizer, **dict(params))
    except TypeError as error:
        raise RayZeroValueError(f"scheduler.params for {kind} are invalid ({error}); see DeepSpeed's "
                         f"documentation of {kind} for the accepted keys") from error
