"""The optimizer a strategy builds over its fp32 master tensors: the config's `optimizer` section or
the client's own optimizer, rebound.

[Note: DeepSpeed's Adam defaults]
DeepSpeed builds "Adam"/"AdamW" with its own kernels (FusedAdam, or DeepSpeedCPUAdam when offloading)
whose defaults are not torch's: `weight_decay` 0 (torch's AdamW: 0.01) and decoupled weight decay
(`adam_w_mode` true) even for type "Adam". `torch_adam: true` makes DeepSpeed pass the params straight
to torch.optim.Adam/AdamW, so torch's own defaults apply. rayzero runs torch's implementations with
DeepSpeed's defaults filled in, so a config without `weight_decay` trains as it does under DeepSpeed
(tests/unit/test_fidelity_optimizer.py checks the defaults against FusedAdam's signature).
"""
from __future__ import annotations

import torch

from rayzero.config import RayZeroConfig
from rayzero.config.errors import RayZeroValueError
from rayzero.engine.offload import OffloadBackend
from rayzero.engine.strategy import OptimizerFactory

TESTED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
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
        params.pop("bias_correction", None)  # only true is runnable (rayzero.config.runnable)
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
    if optimizer_class in TESTED_OPTIMIZERS:
        params = {**offload.fused_optimizer_kwargs(), **params}

    def build(groups: list[dict]) -> torch.optim.Optimizer:
        return optimizer_class(groups, **params)
    return build
