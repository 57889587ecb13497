"""Which parameters the engine trains, under which names, and from which starting values."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from rayzero.config.errors import RayZeroValueError
from rayzero.engine.comm import Communicator


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
        raise RayZeroValueError(
            f"rayzero.initialize found no trainable parameters in {source} (none with requires_grad=True): "
            "unfreeze the parameters to train (param.requires_grad_(True)) or pass a model that has some")
    return groups


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
