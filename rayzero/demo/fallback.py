"""Plain-torch stand-in for `rayzero.initialize`, used by the demo only when the ZeRO engine is absent.

Data parallel with gradients averaged by all_reduce and torch's AdamW; the same engine surface the
demo uses (`engine(x, y)`, `backward`, `step`, `save_checkpoint`, `load_checkpoint`).
"""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist


class TorchDataParallelEngine:
    def __init__(self, model: torch.nn.Module, config: dict[str, Any]) -> None:
        warnings.warn("rayzero.engine.initialize is missing: the demo trains with plain torch data parallel")
        self.module = model
        params = dict(config.get("optimizer", {}).get("params", {}))
        self.optimizer = torch.optim.AdamW(model.parameters(), **params)
        self._clip = float(config.get("gradient_clipping", 0.0))
        self._world = dist.get_world_size() if dist.is_initialized() else 1

    def __call__(self, *inputs: Any) -> torch.Tensor:
        return self.module(*inputs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        for param in self.module.parameters():
            if param.grad is not None and self._world > 1:
                dist.all_reduce(param.grad)
                param.grad /= self._world
        if self._clip > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self._clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def save_checkpoint(self, save_dir: str | None = None, tag: str | None = None,
                        client_state: dict | None = None) -> None:
        save_dir = save_dir or os.environ["RAYZERO_CHECKPOINT_DIR"]
        if not dist.is_initialized() or dist.get_rank() == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save({"module": self.module.state_dict(), "client_state": client_state or {}},
                       os.path.join(save_dir, "fallback.pt"))

    def load_checkpoint(self, load_dir: str, **_: Any) -> tuple[str, dict]:
        state = torch.load(os.path.join(load_dir, "fallback.pt"), weights_only=False)
        self.module.load_state_dict(state["module"])
        return load_dir, state["client_state"]


def torch_ddp_initialize(model: torch.nn.Module, config: dict[str, Any]) -> tuple:
    engine = TorchDataParallelEngine(model, config)
    return engine, engine.optimizer, None, None
