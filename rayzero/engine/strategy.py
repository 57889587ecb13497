"""The interface every ZeRO stage implements, and the one place a stage number picks a class.

The engine (engine.py) drives a training step only through these methods; nothing outside this
module and the stage modules knows which stage runs. See [Note: engine step] in engine.py for the
order in which the engine calls them.
"""
from __future__ import annotations

import abc
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rayzero.checkpoint.types import ShardedTensor, ShardSpec
from rayzero.config.errors import RayZeroValueError
from rayzero.engine.comm import Communicator
from rayzero.engine.offload.backend import OffloadBackend
from rayzero.engine.policies import MixedPrecisionPolicy, ReducePolicy

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]
"""Builds the optimizer over param groups whose `params` are the strategy's fp32 master tensors
(the groups keep the user's hyperparameters: lr, weight_decay, betas, ...)."""


@dataclass(frozen=True)
class StrategyContext:
    """Everything a strategy is built from (read once; the strategy keeps what it needs)."""

    module: torch.nn.Module
    """The user's model, already on the compute device, fp32 (the strategy casts it)."""
    param_groups: list[dict]
    """Optimizer groups of *trainable* parameters, deduplicated (tied weights once), each a dict
    with `params` (list of nn.Parameter, registration order) and the group's hyperparameters."""
    param_names: dict[int, str]
    """id(parameter) -> its first name in module.named_parameters() (checkpoint keys)."""
    comm: Communicator
    precision: MixedPrecisionPolicy
    reduce: ReducePolicy
    offload: OffloadBackend
    zero_config: Any
    """cfg.zero_optimization as given (stage 3 reads its own knobs from it)."""
    build_optimizer: OptimizerFactory
    device: torch.device
    """Compute device (cuda:<local rank> or cpu)."""


class ZeroStrategy(abc.ABC):
    """One ZeRO stage: how gradients are reduced, where master weights and optimizer state live,
    how updated parameters come back to the module.

    Gradients are produced by `loss.backward()` inside `engine.backward`, framed by
    `before_backward` / `after_backward`. At an accumulation boundary the engine then calls
    `finish_gradients`, reads `grad_norm` (which doubles as the overflow check: a non-finite
    norm means some rank overflowed), `scale_gradients`, `optimizer_step`, `zero_grad`.
    """

    stage: ClassVar[int]

    optimizer: torch.optim.Optimizer
    """Built by the strategy over its fp32 master tensors via `ctx.build_optimizer`."""

    def before_forward(self) -> None:
        """Called by `engine(*inputs)` before the module runs (stage 3 gathers here)."""

    @abc.abstractmethod
    def before_backward(self, is_boundary: bool) -> None:
        """A backward pass is about to run; `is_boundary` when it ends an accumulation window."""

    @abc.abstractmethod
    def after_backward(self) -> None:
        """The backward pass finished: flush partially filled buckets, check unused parameters."""

    def loss_divisor(self) -> float:
        """What the engine divides the loss by besides gradient accumulation (and before the loss
        scale): a strategy that reduces gradients by plain sums returns the world size, so the sum
        is already the mean ([Note: gradient averaging]). Default 1: the strategy averages itself."""
        return 1.0

    @abc.abstractmethod
    def finish_gradients(self) -> None:
        """Boundary only: wait for every reduction; afterwards the fp32 master gradients this rank
        owns hold the mean over ranks and micro-batches (still loss-scaled)."""

    @abc.abstractmethod
    def master_gradients(self) -> list[torch.Tensor]:
        """The fp32 gradients this rank feeds its optimizer (no element appears on two ranks when
        `gradients_partitioned`; padding is zero)."""

    gradients_partitioned: ClassVar[bool] = True
    """True when each rank holds a disjoint part of the gradients (norm needs a sum over ranks)."""

    def grad_norm(self, comm: Communicator) -> float:
        """Global L2 norm of the gradients across ranks; inf/NaN when any rank overflowed."""
        grads = [g for g in self.master_gradients() if g.numel() > 0]
        device = grads[0].device if grads else torch.device("cpu")
        square = torch.zeros((), dtype=torch.float32, device=device)
        if grads:
            # Each norm on its gradient's device, then gathered on one: with partial offload
            # (offload_optimizer.ratio) some master gradients live on the GPU and some on the host.
            square = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).to(device) for g in grads]
                                 ).square().sum()
        if self.gradients_partitioned:
            comm.all_reduce_control(square, "sum")
        return float(square.sqrt())  # a sync point: the step's skip/clip decision needs it

    def scale_gradients(self, factor: float) -> None:
        """Multiply the master gradients by `factor` (unscale and clip in one pass)."""
        if factor != 1.0:
            for grad in self.master_gradients():
                grad.mul_(factor)

    def enable_step_overlap(self) -> bool:
        """Run the offloaded optimizer step bucket by bucket during backward, where this stage and
        the backend can ([Note: step overlapped with backward]); False: it runs after backward."""
        return False

    @abc.abstractmethod
    def optimizer_step(self) -> None:
        """Run the optimizer where the offload backend keeps its state, then publish the updated
        weights to the module's parameters (copy / all-gather)."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Clear gradients after a step (taken or skipped)."""

    # ---- checkpoint seam ([Note: flat-range partitioning], rayzero/checkpoint/types.py) --------
    @abc.abstractmethod
    def state_shards(self) -> list[ShardedTensor]:
        """`module/<name>`, `master/<name>`, `optim/<key>/<name>` pieces this rank holds."""

    @abc.abstractmethod
    def load_state_shards(self, read: Callable[[ShardSpec], torch.Tensor]) -> None:
        """Ask `read` for the pieces this rank needs in its own layout and install them."""

    @abc.abstractmethod
    def memory_stats(self) -> dict[str, int]:
        """Bytes held by this rank: params, grads, master_weights, optimizer_state, buffers."""

    def describe_layout(self, comm: Communicator) -> dict[str, Any]:
        """The node layout and this rank's groups (`engine.layout()`): stages 0-2 shard over the
        whole group; stage 3 says its own ([Note: stage-3 layouts])."""
        return {"nodes": comm.topology.describe(), "node_of_rank": list(comm.topology.node_of),
                "shard_group": list(comm.ranks)}

    def close(self) -> None:
        """Remove hooks (the engine is being discarded)."""


# stage -> "module:Class"; imported lazily so a stage's module is only loaded when used.
_STAGES = {
    0: "rayzero.engine.bucketed.stage0:Stage0Strategy",
    1: "rayzero.engine.bucketed.stage1:Stage1Strategy",
    2: "rayzero.engine.bucketed.stage2:Stage2Strategy",
    3: "rayzero.engine.stage3.strategy:Stage3Strategy",
}


def build_strategy(stage: int, ctx: StrategyContext) -> ZeroStrategy:
    """The strategy for `zero_optimization.stage` — the only stage dispatch in the engine."""
    if stage not in _STAGES:
        raise RayZeroValueError(f"zero_optimization.stage={stage!r} is not a ZeRO stage: use 0, 1, 2 or 3")
    module_name, class_name = _STAGES[stage].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(ctx)
