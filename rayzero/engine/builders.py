"""Turning `rayzero.initialize`'s arguments into the pieces the engine is made of: the config,
the trainable parameter groups, the optimizer factory and the data loader."""
from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from rayzero.checkpoint.data_position import ResumableSampler
from rayzero.config import RayZeroConfig, load_config
from rayzero.engine.comm import Communicator
from rayzero.engine.offload import OffloadBackend
from rayzero.engine.strategy import OptimizerFactory

CONFIG_ENV = "RAYZERO_CONFIG"
"""Path to a JSON config, or the JSON text itself; the Ray worker sets it for the user's loop."""

TESTED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""Optimizers whose update is elementwise, so running them on flat shards equals running them on
whole parameters. Others (LAMB, Adafactor, Shampoo...) may read whole-tensor statistics."""


def detect_hidden_size(model: torch.nn.Module) -> int | None:
    """`model.config.hidden_size` if present, else the most common Linear `in_features`."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(hidden, int):
        return hidden
    counts = collections.Counter(m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    return counts.most_common(1)[0][0] if counts else None


def resolve_config(config: Any, world_size: int, model: torch.nn.Module) -> RayZeroConfig:
    """A validated config with "auto" resolved for this world size and model."""
    if config is None:
        text = os.environ.get(CONFIG_ENV)
        if not text:
            raise ValueError(
                f"rayzero.initialize got no config and ${CONFIG_ENV} is not set: pass config= (a path to a "
                f"DeepSpeed JSON file, a dict or a RayZeroConfig) or set {CONFIG_ENV} to a path or JSON text")
        stripped = text.strip()
        config = json.loads(stripped) if stripped.startswith("{") else Path(stripped)
    elif isinstance(config, str) and config.strip().startswith("{"):
        config = json.loads(config)
    # hidden_size is only a fact for resolving "auto" bucket sizes: pass it only when one is left,
    # so explicit values are never second-guessed by a guess at the model's width.
    first = load_config(config, world_size=world_size, allow_unresolved=True)
    if not _has_auto(first.model_dump()):
        return first
    return load_config(config, world_size=world_size, hidden_size=detect_hidden_size(model))


def _has_auto(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_auto(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_auto(v) for v in value)
    return value == "auto"


def trainable_param_groups(model: torch.nn.Module, model_parameters: Any,
                           client_optimizer: torch.optim.Optimizer | None) -> list[dict]:
    """Optimizer groups of trainable parameters, each parameter once (tied weights deduplicated).

    Source, in order: the client optimizer's groups, `model_parameters` (parameters or group dicts),
    the model's parameters. Groups left empty are kept so group indices (per-group lr lists of a
    scheduler) stay stable.
    """
    if client_optimizer is not None:
        raw = client_optimizer.param_groups
    elif model_parameters is not None:
        items = list(model_parameters)
        raw = items if items and isinstance(items[0], dict) else [{"params": items}]
    else:
        raw = [{"params": list(model.parameters())}]
    seen: set[int] = set()
    groups = []
    for group in raw:
        params = []
        for param in group["params"]:
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    if not seen:  # torch optimizers refuse an empty parameter list; training nothing would be silent
        source = ("the optimizer's param_groups" if client_optimizer is not None
                  else "model_parameters" if model_parameters is not None else "the model")
        raise ValueError(
            f"rayzero.initialize found no trainable parameters in {source} (none with requires_grad=True): "
            "unfreeze the parameters to train (param.requires_grad_(True)) or pass a model that has some")
    return groups


def _config_optimizer_class(kind: str, params: dict, allow_untested: bool) -> type:
    name = kind.lower()
    if name == "adam":
        # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false (FusedAdam default).
        return torch.optim.AdamW if params.pop("adam_w_mode", True) else torch.optim.Adam
    if name == "adamw":
        return torch.optim.AdamW
    if name == "sgd":
        return torch.optim.SGD
    candidate = {n.lower(): getattr(torch.optim, n) for n in dir(torch.optim)}.get(name)
    if isinstance(candidate, type) and issubclass(candidate, torch.optim.Optimizer) and allow_untested:
        return candidate
    raise ValueError(
        f"optimizer.type={kind!r} is not supported: use Adam, AdamW or SGD, or a torch.optim name together "
        "with zero_allow_untested_optimizer=true, or pass optimizer= to rayzero.initialize")


def optimizer_factory(cfg: RayZeroConfig, client: torch.optim.Optimizer | None,
                      offload: OffloadBackend) -> OptimizerFactory:
    """How the strategy builds its optimizer over its fp32 master tensors."""
    stage = cfg.zero_optimization.stage
    if client is not None and cfg.optimizer is not None:
        raise ValueError(
            "an optimizer was passed to rayzero.initialize and the config has an `optimizer` section: "
            "remove one of them")
    if client is not None:
        if stage > 0 and not isinstance(client, TESTED_OPTIMIZERS) and not cfg.zero_allow_untested_optimizer:
            raise ValueError(
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
        raise ValueError("no optimizer: add an `optimizer` section to the config or pass optimizer= "
                         "to rayzero.initialize")
    params = {k: (tuple(v) if isinstance(v, list) else v) for k, v in dict(cfg.optimizer.params).items()}
    for deepspeed_only in ("torch_adam", "fp32_optimizer_states", "adam_w_mode_default"):
        params.pop(deepspeed_only, None)
    optimizer_class = _config_optimizer_class(cfg.optimizer.type, params, cfg.zero_allow_untested_optimizer)
    if optimizer_class in TESTED_OPTIMIZERS:
        params = {**offload.fused_optimizer_kwargs(), **params}

    def build(groups: list[dict]) -> torch.optim.Optimizer:
        return optimizer_class(groups, **params)
    return build


def build_dataloader(training_data: Any, micro_batch_size: int | None, global_batch_size: int | None,
                     comm: Communicator, collate_fn: Any = None) -> torch.utils.data.DataLoader | None:
    """A loader giving each rank its share of `training_data` in micro batches (DeepSpeed's).

    Its sampler is a `ResumableSampler`, not torch's DistributedSampler: the same interleaved
    split, but its position is a global sample count, so `load_checkpoint` resumes it mid-epoch at
    any world size ([Note: data position]). Shuffled with seed 0 like DistributedSampler; call
    `loader.sampler.set_epoch(epoch)` per epoch, starting from `loader.sampler.epoch` after a resume.
    """
    if training_data is None:
        return None
    if micro_batch_size is None or global_batch_size is None:
        raise ValueError("training_data was given but train_micro_batch_size_per_gpu is not set: set it "
                         "(or train_batch_size and gradient_accumulation_steps) in the config")
    sampler = ResumableSampler(len(training_data), global_batch_size=global_batch_size, rank=comm.rank,
                               world_size=comm.world_size, shuffle=True, seed=0)
    return torch.utils.data.DataLoader(training_data, batch_size=micro_batch_size, sampler=sampler,
                                       collate_fn=collate_fn)


def named_parameter_ids(model: torch.nn.Module) -> dict[int, str]:
    """id(param) -> first name (a tied weight is saved under the name it is first registered as)."""
    return {id(param): name for name, param in model.named_parameters()}


def broadcast_module_state(model: torch.nn.Module, comm: Communicator,
                           tensors: Iterable[torch.Tensor] | None = None) -> None:
    """Make every rank start from rank 0's parameters and buffers (DeepSpeed does the same)."""
    if not comm.distributed:
        return
    with torch.no_grad():
        for tensor in tensors if tensors is not None else [*model.parameters(), *model.buffers()]:
            if tensor.device.type != "meta":
                comm.broadcast(tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor, src=0)
