"""The optimizer a strategy builds over its fp32 master tensors: the config's `optimizer` section or
the client's own optimizer, rebound.

[Note: DeepSpeed's Adam defaults]
DeepSpeed builds "Adam"/"AdamW" with its own kernels (FusedAdam, or DeepSpeedCPUAdam when offloading)
whose defaults are not torch's: `weight_decay` 0 (torch's AdamW: 0.01) and decoupled weight decay
(`adam_w_mode` true) even for type "Adam". `torch_adam: true` makes DeepSpeed pass the params straight
to torch.optim.Adam/AdamW, so torch's own defaults apply. rayzero runs torch's implementations with
DeepSpeed's defaults filled in, so a config without `weight_decay` trains as it does under DeepSpeed
(tests/unit/test_fidelity_optimizer.py checks the defaults against FusedAdam's signature).

[Note: Adam without bias correction]
`optimizer.params.bias_correction: false` (BERT-era configs: DeepSpeed's BingBertSquad tests and
examples) makes DeepSpeed's kernels step `p -= lr · m / (√v + ε)`: the moments are Adam's, the
1/(1-β1^t) and 1/√(1-β2^t) factors are 1 (csrc/includes/cpu_adam.h `update_state`; FusedAdam and
DeepSpeedCPUAdam run the same formula). torch's Adam/AdamW always correct, so that flag builds
`DeepSpeedAdam` below instead: the same update written with torch's in-place tensor ops. Its state
has torch Adam's keys (`step`, `exp_avg`, `exp_avg_sq`), so checkpoints, resharding, NVMe tiles and
the step overlapped with backward treat it as they treat torch's Adam (all of them call `step()`
on whatever tensors they hand it). It is slower than torch's fused kernel (several passes over
each tensor instead of one), the price of a flag only older configs set.
"""
from __future__ import annotations

import math

import torch

from rayzero.config import RayZeroConfig
from rayzero.config.errors import RayZeroValueError
from rayzero.engine.offload.backend import OffloadBackend
from rayzero.engine.strategy import OptimizerFactory


class DeepSpeedAdam(torch.optim.Optimizer):
    """DeepSpeed's FusedAdam / DeepSpeedCPUAdam update, including `bias_correction=False`, which
    torch's Adam lacks ([Note: Adam without bias correction]). `adam_w_mode`: decoupled weight
    decay (`p *= 1 - lr·wd`) as AdamW, else L2 (`g += wd·p`) as Adam."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bias_correction: bool = True, adam_w_mode: bool = True) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "bias_correction": bias_correction, "adam_w_mode": adam_w_mode})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, decay = group["lr"], group["weight_decay"]
            # DeepSpeed's kernel forms 1 - β in float32 (`1 - _betta2` of a float): for β2 = 0.999 that
            # is 1.3e-5 off the double's value, which would otherwise move v by as much every step.
            one_minus_beta1, one_minus_beta2 = (float(1 - torch.tensor(beta, dtype=torch.float32))
                                                for beta in (beta1, beta2))
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:  # torch Adam's layout: a float32 step count, zeroed moments
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] += 1
                grad = param.grad
                if decay and not group["adam_w_mode"]:
                    grad = grad.add(param, alpha=decay)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=one_minus_beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=one_minus_beta2)
                denom = exp_avg_sq.sqrt()
                step_size = lr
                if group["bias_correction"]:
                    step = float(state["step"])
                    step_size = lr / (1 - beta1 ** step)
                    denom.div_(math.sqrt(1 - beta2 ** step))
                denom.add_(group["eps"])
                if decay and group["adam_w_mode"]:
                    param.mul_(1 - lr * decay)
                param.addcdiv_(exp_avg, denom, value=-step_size)
        return loss


TORCH_FUSED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""torch optimizers with fused kernels (`fused=True`, offload.fused_optimizer_kwargs)."""
TESTED_OPTIMIZERS = (*TORCH_FUSED_OPTIMIZERS, DeepSpeedAdam)
"""Optimizers whose update is elementwise, so running them on flat shards equals running them on
whole parameters. Others (LAMB, Adafactor, Shampoo...) may read whole-tensor statistics."""


def _config_optimizer(kind: str, params: dict, stage: int, allow_untested: bool) -> tuple[type, dict]:
    """(optimizer class, keyword arguments) for the config's `optimizer` section, as DeepSpeed
    0.19's `_configure_basic_optimizer` builds it ([Note: DeepSpeed's Adam defaults])."""
    name = kind.lower()
    params = dict(params)
    if name in ("adam", "adamw"):
        # "AdamW" always decouples weight decay; "Adam" does unless adam_w_mode is false.
        decoupled = params.pop("adam_w_mode", True) or name == "adamw"
        torch_adam = params.pop("torch_adam", False)
        params.pop("fp32_optimizer_states", None)
        if params.pop("bias_correction", True) is False:  # [Note: Adam without bias correction]
            for flag in ("amsgrad", "maximize", "fused", "foreach"):  # runnable refuses amsgrad/maximize true
                params.pop(flag, None)
            params.setdefault("weight_decay", 0.0)
            return DeepSpeedAdam, {**params, "bias_correction": False, "adam_w_mode": bool(decoupled)}
        optimizer_class = torch.optim.AdamW if decoupled else torch.optim.Adam
        if not torch_adam:
            params.setdefault("weight_decay", 0.0)
        return optimizer_class, params
    if name == "sgd":
        return torch.optim.SGD, params
    candidate = {n.lower(): getattr(torch.optim, n) for n in dir(torch.optim)}.get(name)
    if isinstance(candidate, type) and issubclass(candidate, torch.optim.Optimizer) and (
            allow_untested or stage == 0):
        return candidate, params
    raise RayZeroValueError(
        f"optimizer.type={kind!r} is not supported: use Adam, AdamW or SGD, or a torch.optim name together "
        "with zero_allow_untested_optimizer=true, or pass optimizer= to rayzero.initialize")


def optimizer_factory(cfg: RayZeroConfig, client: torch.optim.Optimizer | None,
                      offload: OffloadBackend) -> OptimizerFactory:
    """How the strategy builds its optimizer over its fp32 master tensors."""
    stage = cfg.zero_optimization.stage
    if client is not None and cfg.optimizer is not None:
        raise RayZeroValueError(
            "an optimizer was passed to rayzero.initialize and the config has an `optimizer` section: "
            "remove one of them")
    if client is not None:
        if stage > 0 and not isinstance(client, TESTED_OPTIMIZERS) and not cfg.zero_allow_untested_optimizer:
            raise RayZeroValueError(
                f"optimizer {type(client).__name__} has not been tested with ZeRO stage {stage} (its update "
                "may read whole-parameter statistics, which a shard does not have): set "
                "zero_allow_untested_optimizer=true to use it anyway, or use Adam, AdamW or SGD")

        def rebind(groups: list[dict]) -> torch.optim.Optimizer:
            # DeepSpeed's approach: keep the client's object and hyperparameters, point its groups
            # at the master tensors. Any state it already had belongs to the old tensors: drop it.
            for target, group in zip(client.param_groups, groups):
                target["params"] = group["params"]
            client.state.clear()
            return client
        return rebind
    if cfg.optimizer is None:
        raise RayZeroValueError("no optimizer: add an `optimizer` section to the config or pass optimizer= "
                         "to rayzero.initialize")
    params = {k: (tuple(v) if isinstance(v, list) else v) for k, v in dict(cfg.optimizer.params).items()}
    optimizer_class, params = _config_optimizer(cfg.optimizer.type, params, stage, cfg.zero_allow_untested_optimizer)
    if optimizer_class in TORCH_FUSED_OPTIMIZERS:
        params = {**offload.fused_optimizer_kwargs(), **params}

    def build(groups: list[dict]) -> torch.optim.Optimizer:
        return optimizer_class(groups, **params)
    return build
