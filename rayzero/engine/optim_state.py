"""Generic access to a torch optimizer's per-parameter state, for checkpoints and resharding.

Any torch optimizer keeps, per parameter, *elementwise* tensors (Adam's exp_avg, SGD's
momentum_buffer: same numel as the parameter, so they shard like it) and *scalar* entries (Adam's
step). Which keys exist is learnt from a probe: the same optimizer class with the same
hyperparameters, stepped once on a three-element parameter. That works for optimizers the engine has
never seen (zero_allow_untested_optimizer) without a table of known keys.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from rayzero.config.errors import RayZeroValueError

_PROBE_NUMEL = 3


def _probe_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state one step creates for a fresh 3-element parameter of the first group."""
    group = optimizer.param_groups[0]
    probe = torch.zeros(_PROBE_NUMEL, requires_grad=True)
    hyper = {k: v for k, v in group.items() if k != "params"}
    for flag in ("fused", "capturable", "differentiable"):
        hyper.pop(flag, None)  # the probe lives on the CPU
    clone = type(optimizer)([{"params": [probe], **hyper}], **_defaults(optimizer))
    probe.grad = torch.ones_like(probe)
    clone.step()
    return dict(clone.state[probe])


def _defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (AdamW records keys it does not take)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items()
            if k in accepted and k not in ("fused", "capturable", "differentiable")}


def _existing_state(optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, dict] | None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            if optimizer.state.get(param):
                return param, optimizer.state[param]
    return None


def elementwise_state_keys(optimizer: torch.optim.Optimizer) -> list[str]:
    """State keys holding one value per parameter element, sorted."""
    existing = _existing_state(optimizer)
    if existing is not None:
        param, state = existing
        return sorted(k for k, v in state.items()
                      if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == param.numel())
    state = _probe_state(optimizer)
    return sorted(k for k, v in state.items()
                  if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == _PROBE_NUMEL)


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create zeroed state for every parameter that has none yet (before loading into it)."""
    missing = [p for g in optimizer.param_groups for p in g["params"] if not optimizer.state.get(p)]
    if not missing:
        return
    template = _probe_state(optimizer)
    for param in missing:
        optimizer.state[param] = _zeroed(template, param)


def scalar_state(optimizer: torch.optim.Optimizer) -> list[dict[str, float]]:
    """Per param group, the scalar state entries (e.g. `step`), JSON-able.

    Every parameter of a group is stepped together, so one value per group describes them all —
    which keeps the record independent of how many bucket tensors the group has at this world size.
    """
    out = []
    for group in optimizer.param_groups:
        entry: dict[str, float] = {}
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() == 0 or isinstance(value, (int, float)):
                    entry[key] = float(value)
            if entry:
                break
        out.append(entry)
    return out


def load_scalar_state(optimizer: torch.optim.Optimizer, groups: list[dict[str, float]]) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise RayZeroValueError(
            f"checkpoint has optimizer state for {len(groups)} parameter groups but the optimizer has "
            f"{len(optimizer.param_groups)}: build the optimizer with the same param groups as the run "
            "that wrote the checkpoint")
    ensure_optimizer_state(optimizer)
    for group, entry in zip(optimizer.param_groups, groups):
        for param in group["params"]:
            state = optimizer.state[param]
            for key, value in entry.items():
                if isinstance(state.get(key), torch.Tensor):
                    state[key].fill_(value)
                else:
                    state[key] = value


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """JSON-able hyperparameters per group (lr, betas, ...), for extra_state."""
    out = []
    for group in optimizer.param_groups:
        entry = {}
        for key, value in group.items():
            if key == "params":
                continue
            if isinstance(value, (int, float, bool, str)) or value is None:
                entry[key] = value
            elif isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value):
                entry[key] = list(value)
        out.append(entry)
    return out


def zero_state_template(optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The state a fresh parameter gets (elementwise entries as (dtype, None), scalars as zero
    values) when starting from that zeroed state is *exactly* torch's own first step, else None.

    True for Adam/AdamW (zero moments, step 0); false for SGD with dampening (its first step copies
    the gradient into the momentum buffer). Checked on a probe, bitwise, so any optimizer works.
    """
    template = _probe_state(optimizer)
    group = optimizer.param_groups[0]
    hyper = {k: v for k, v in group.items() if k not in ("params", "fused", "capturable", "differentiable")}
    grad = torch.tensor([0.5, -1.25, 3.0])
    results = []
    for pre_initialised in (False, True):
        probe = torch.tensor([1.0, -2.0, 0.25], requires_grad=True)
        clone = type(optimizer)([{"params": [probe], **hyper}], **_defaults(optimizer))
        if pre_initialised:
            clone.state[probe] = _zeroed(template, probe)
        probe.grad = grad.clone()
        clone.step()
        clone.step()
        results.append((probe.detach().clone(), {k: v for k, v in clone.state[probe].items()}))
    (fresh, fresh_state), (zeroed, zeroed_state) = results
    same = torch.equal(fresh, zeroed) and fresh_state.keys() == zeroed_state.keys() and all(
        torch.equal(torch.as_tensor(fresh_state[k]), torch.as_tensor(zeroed_state[k])) for k in fresh_state)
    return template if same else None


def _zeroed(template: dict[str, Any], param: torch.Tensor) -> dict[str, Any]:
    state = {}
    for key, value in template.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == _PROBE_NUMEL:
            state[key] = torch.zeros_like(param, dtype=value.dtype)
        elif isinstance(value, torch.Tensor):
            state[key] = torch.zeros_like(value)
        else:
            state[key] = type(value)(0) if isinstance(value, (int, float)) else value
    return state
