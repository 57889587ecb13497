"""`rayzero.initialize`: DeepSpeed's entry point, building a `ZeroEngine` from a model and config."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from rayzero.config.errors import RayZeroValueError
from rayzero.engine.autocast import build_autocast_policy
from rayzero.engine.comm import Communicator
from rayzero.engine.config_resolution import resolve_config
from rayzero.engine.data import build_dataloader
from rayzero.engine.distributed import compute_device, init_distributed
from rayzero.engine.engine import StepPolicy, ZeroEngine, ensure_not_wrapped
from rayzero.engine.logs import show_engine_logs
from rayzero.engine.loss_scaler import build_loss_scaler
from rayzero.engine.offload.backend import build_offload_backend
from rayzero.engine.offload.overlapped_step import overlap_allowed
from rayzero.engine.optimizers import TESTED_OPTIMIZERS, optimizer_factory
from rayzero.engine.param_groups import broadcast_module_state, named_parameter_ids, trainable_param_groups
from rayzero.engine.policies import MixedPrecisionPolicy, ReducePolicy
from rayzero.engine.schedulers import build_scheduler
from rayzero.engine.strategy import StrategyContext, build_strategy


def initialize(args: Any = None, model: torch.nn.Module | None = None,
               optimizer: torch.optim.Optimizer | None = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: int | None = None,
               mpu: Any = None, dist_init_required: bool | None = None, collate_fn: Any = None,
               config: Any = None, mesh_param: Any = None, config_params: Any = None,
               process_group: dist.ProcessGroup | None = None, engine_class: type[ZeroEngine] = ZeroEngine,
               ) -> tuple[ZeroEngine, torch.optim.Optimizer, Any, Any]:
    """Wrap `model` for ZeRO training: returns `(engine, optimizer, dataloader, lr_scheduler)`.

    `deepspeed.initialize`'s parameters, in its order. `config` is a path, JSON text, dict or
    `RayZeroConfig`; else `args.deepspeed_config` (an argparse namespace from a parser given
    `rayzero.add_config_arguments`), else `config_params`, else $RAYZERO_CONFIG (a path or JSON
    text). Uses `process_group` or the default process group, initialising it from RANK/WORLD_SIZE/
    MASTER_ADDR/MASTER_PORT (`distributed_port` when MASTER_PORT is unset) unless
    `dist_init_required=False`; with none of them, trains as a world of one. `optimizer` (a torch
    optimizer over the model's parameters) and `lr_scheduler` (a scheduler or a callable taking the
    optimizer) replace the config's `optimizer` / `scheduler` sections. `mpu` and `mesh_param`
    (model or sequence parallelism) are refused: rayzero is data parallel. `engine_class` is the
    class built, a `ZeroEngine` subclass (rayzero.compat passes DeepSpeed's `DeepSpeedEngine`).
    """
    if model is None and isinstance(args, torch.nn.Module):  # initialize(model, ...): rayzero's older order
        args, model = None, args
    if model is None:
        raise RayZeroValueError("rayzero.initialize needs model=: the torch.nn.Module to train")
    config = _config_source(args, config, config_params)
    for name, value in (("mpu", mpu), ("mesh_param", mesh_param)):
        if value is not None:
            raise RayZeroValueError(
                f"rayzero.initialize({name}=...): model/sequence parallel groups are not supported (rayzero "
                f"trains data parallel, with ZeRO sharding across every rank); remove {name}")
    ensure_not_wrapped(model)  # before anything touches its parameters ([Note: one engine per module])
    show_engine_logs()
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ and dist_init_required is not False:
        if distributed_port is not None:
            os.environ.setdefault("MASTER_PORT", str(distributed_port))
        init_distributed()
    comm = Communicator(process_group)
    if comm.distributed and comm.group is dist.group.WORLD:
        comm.discover_topology()  # [Note: topology]: layouts and link classes follow node boundaries
    cfg = resolve_config(config, comm.world_size, model)
    zero = cfg.zero_optimization
    device = compute_device()
    if not any(p.device.type == "meta" for p in model.parameters()):
        model.to(device)  # a model built partitioned (stage 3 zero_init) places itself
    autocast = build_autocast_policy(cfg.torch_autocast, model, device)  # [Note: torch_autocast]
    precision = MixedPrecisionPolicy.from_config(cfg, autocast)
    offload = build_offload_backend(cfg, device, comm.rank)
    groups = trainable_param_groups(model, model_parameters, optimizer)
    broadcast_module_state(model, comm)
    ctx = StrategyContext(
        module=model, param_groups=groups, param_names=named_parameter_ids(model), comm=comm,
        precision=precision, reduce=ReducePolicy.from_config(zero), offload=offload, zero_config=zero,
        build_optimizer=optimizer_factory(cfg, optimizer, offload), device=device)
    strategy = build_strategy(zero.stage, ctx)
    if lr_scheduler is None:
        scheduler = build_scheduler(cfg.scheduler, strategy.optimizer)
    elif callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        scheduler = lr_scheduler(strategy.optimizer)
    else:
        scheduler = lr_scheduler
    step_policy = StepPolicy(gradient_accumulation_steps=int(cfg.gradient_accumulation_steps or 1),
                             gradient_clipping=float(cfg.gradient_clipping or 0.0),
                             micro_batch_size=cfg.train_micro_batch_size_per_gpu)
    if overlap_allowed(step_policy.gradient_clipping, precision.scales_loss, strategy.optimizer,
                       TESTED_OPTIMIZERS):
        strategy.enable_step_overlap()
    loss_scaler = build_loss_scaler(cfg.fp16, autocast_fp16=autocast is not None and autocast.scales_loss)
    engine = engine_class(model, strategy, comm, precision, step_policy, loss_scaler, scheduler, cfg)
    loader = build_dataloader(training_data, step_policy.micro_batch_size,
                                       cfg.train_batch_size or engine.train_batch_size(), comm, collate_fn)
    engine.training_dataloader = loader
    comm.discard_current()  # initial broadcasts belong to no step
    return engine, strategy.optimizer, loader, scheduler


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The config `deepspeed.initialize` would use: `config`, `args.deepspeed_config` (or the older
    `args.deepscale_config`), then `config_params`; two of them at once is an error, as there."""
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None and config is not None:
        raise RayZeroValueError(
            f"rayzero.initialize got a config twice: config= and args.deepspeed_config={from_args!r}; "
            "pass one of them")
    return config if config is not None else from_args if from_args is not None else config_params


def add_config_arguments(parser: Any) -> Any:
    """`deepspeed.add_config_arguments`: adds `--deepspeed`, `--deepspeed_config` (and the older
    `--deepscale`, `--deepscale_config`) to an argparse parser, for `initialize(args=...)`."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (rayzero)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed-style training (accepted for compatibility)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated: --deepspeed_config")
    return parser
