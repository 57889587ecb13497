"""The accessors of DeepSpeed's engine that training code and trainers call (HF's Trainer reads
`get_global_grad_norm`, Accelerate `was_step_applied`, DeepSpeed's examples `local_rank`, ...), kept
out of engine.py so the step itself reads on one screen. Each reads state `ZeroEngine` owns."""
from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rayzero.engine.engine import ZeroEngine


class DeepSpeedAccessors:
    """Mixed into `ZeroEngine`: DeepSpeed's names for what the engine already knows."""

    module: torch.nn.Module
    strategy: Any
    comm: Any
    config: Any
    step_policy: Any
    micro_steps: int
    last_grad_norm: float | None
    step_applied: bool
    boundary_override: bool | None
    phase: Any

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.strategy.optimizer

    @property
    def device(self) -> torch.device:
        return next(iter(self.module.parameters())).device

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks: every rank (rayzero has no model parallelism)."""
        return self.comm.world_size

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (LOCAL_RANK, set by torchrun and rayzero's workers)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    def gradient_accumulation_steps(self) -> int:
        return self.step_policy.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self.step_policy.micro_batch_size

    def train_batch_size(self) -> int | None:
        micro = self.step_policy.micro_batch_size
        return None if micro is None else micro * self.gradient_accumulation_steps() * self.world_size

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next backward ends an accumulation window: counted from the micro steps, or
        what the caller last told `set_gradient_accumulation_boundary`."""
        if self.boundary_override is not None:
            return self.boundary_override
        return (self.micro_steps + 1) % self.step_policy.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's: the caller says whether the next backward ends an accumulation window, instead
        of the engine counting micro steps. Accelerate (and so HF's Trainer) calls it before every
        backward and calls `step()` only when it passed True; as in DeepSpeed, once called it stays
        in charge for the engine's life."""
        self.boundary_override = bool(is_boundary)

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        """Each group's momentum: Adam's betas, SGD's momentum (DeepSpeed's `get_mom`)."""
        return [group["betas"] if "betas" in group else group.get("momentum") for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (unscaled, before clipping); None when the step
        did not need it (no clipping, no fp16), as DeepSpeed returns None where it computed none."""
        return self.last_grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last `step()` updated the weights: False between accumulation boundaries and
        after an fp16 overflow skipped the step."""
        return self.step_applied

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled is True

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled is True

    def zero_optimization_stage(self) -> int:
        return int(self.config.zero_optimization.stage)

    def gradient_clipping(self) -> float:
        return float(self.step_policy.gradient_clipping)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """`zero_optimization.stage3_gather_16bit_weights_on_model_save` (Accelerate reads it)."""
        return bool(self.config.zero_optimization.gather_16bit_weights_on_model_save)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients of an unfinished accumulation window; after `step()` there are none
        (the step clears them), so the call trainers make after every step costs nothing."""
        if self.phase.name != "IDLE":
            self.strategy.zero_grad()
            self.phase = type(self.phase).IDLE

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> dict[str, torch.Tensor] | None:
        """DeepSpeed's: the whole module state dict in the compute dtype, on CPU, on rank 0 (None on
        the others); every rank must call it. Gathered one module's parameters at a time; a tied
        weight appears under each of its names as one tensor; non-persistent buffers are left out."""
        if self.zero_optimization_stage() != 3:
            raise ValueError("this function requires ZeRO-3 mode")  # DeepSpeed's error, which callers catch
        from rayzero.engine.stage3.gathered import GatheredParameters

        rank0 = self.comm.rank == 0
        state: dict[str, torch.Tensor] | None = collections.OrderedDict() if rank0 else None
        first_name: dict[int, str] = {}
        for prefix, module in self.module.named_modules():
            prefix = f"{prefix}." if prefix else ""
            own = list(module.parameters(recurse=False))
            with GatheredParameters(own):
                if state is None:
                    continue
                for name, param in module.named_parameters(recurse=False):
                    if exclude_frozen_parameters and not param.requires_grad:
                        continue
                    if id(param) in first_name:
                        state[prefix + name] = state[first_name[id(param)]]
                    else:
                        state[prefix + name] = param.detach().cpu().clone()
                        first_name[id(param)] = prefix + name
                for name, buffer in module.named_buffers(recurse=False):
                    if buffer is not None and name not in module._non_persistent_buffers_set:
                        state[prefix + name] = buffer.detach().cpu().clone()
        return state

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self  # type: ignore[return-value]

    def eval(self) -> ZeroEngine:
        return self.train(False)
