"""What the ranks of tests/dist/test_path_deepspeed_import.py run: DeepSpeed 0.19.8 on CPU writes a
ZeRO checkpoint and continues; rayzero imports it and continues from the same point."""
from __future__ import annotations

import os

import torch

STEPS_BEFORE, STEPS_AFTER = 3, 10
IN, HIDDEN, OUT = 6, 10, 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(IN, HIDDEN)
        self.second = torch.nn.Linear(HIDDEN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, OUT)
        self.register_buffer("offset", torch.arange(OUT, dtype=torch.float32) / 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.second(torch.relu(self.first(x))))
        return torch.nn.functional.mse_loss(self.out(hidden) + self.offset, y)


def config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8,
                                                  "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 6}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
    }


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, IN, generator=generator), torch.randn(4, OUT, generator=generator)


def train(engine, rank: int, steps: range) -> list[float]:
    """The steps' losses, trained in this rank (DeepSpeed's engine or rayzero's alike)."""
    losses = []
    for step in steps:
        loss = engine(*batch(step, rank))
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    return losses


def deepspeed_worker(rank: int, world: int, payload: dict) -> dict:
    import deepspeed

    out = {}
    for stage in payload["stages"]:
        torch.manual_seed(0)
        engine, _, _, _ = deepspeed.initialize(model=Net(), config=config(stage))
        train(engine, rank, range(STEPS_BEFORE))
        engine.save_checkpoint(os.path.join(payload["dir"], f"stage{stage}"))
        out[stage] = train(engine, rank, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
        if stage == 2:  # whole weights on every rank at stage 2: the end point to meet at another world size
            out["final_stage2"] = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    return out


def rayzero_worker(rank: int, world: int, payload: dict) -> dict:
    import rayzero

    out = {}
    for source, target_stage in payload["runs"]:
        torch.manual_seed(123)  # different init: everything must come from the checkpoint
        cfg = config(target_stage)
        cfg["optimizer"]["params"].pop("torch_adam")
        engine, _, _, _ = rayzero.initialize(model=Net(), config=cfg)
        path, _ = engine.load_checkpoint(source)
        assert path is not None, source
        out[(source, target_stage)] = train(engine, rank, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    return out


def rayzero_one_rank_worker(rank: int, world: int, payload: dict) -> dict:
    """The imported stage-2 checkpoint continued on ONE rank, both of DeepSpeed's ranks' micro-batches
    accumulated per step: the same global batch, so the same end point."""
    import rayzero

    cfg = config(2)
    cfg["optimizer"]["params"].pop("torch_adam")
    cfg["gradient_accumulation_steps"] = 2
    torch.manual_seed(123)
    engine, _, _, _ = rayzero.initialize(model=Net(), config=cfg)
    path, _ = engine.load_checkpoint(payload["source"])
    assert path is not None
    for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        for ds_rank in (0, 1):
            loss = engine(*batch(step, ds_rank))
            engine.backward(loss)
            engine.step()
    return {name: p.detach().clone() for name, p in engine.module.named_parameters()}
