"""DeepSpeed 0.19.8 as the oracle: the same model, config and batches trained by `deepspeed.initialize`
and by `rayzero.initialize` on 2 gloo ranks (CPU), each side in its own spawned group (DeepSpeed keeps
process-wide state, e.g. its autocast flags), many cases per group.

`Run`: one case, a DeepSpeed config given to both sides, and the knobs only one side reads
(`rayzero_zero`: rayzero-only zero_optimization items, e.g. an NVMe path DeepSpeed cannot use here
without libaio). Each side returns, per case, its rank's loss per step and the final parameters,
whole (stage 3: gathered).
"""
from __future__ import annotations

import os
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

VOCAB, WIDTH, HIDDEN, SEQ, MICRO = 23, 15, 37, 5, 4


class Net(torch.nn.Module):
    """Every kind of module torch_autocast treats differently: Linear and Conv1d (DeepSpeed's
    lower-precision-safe modules), LayerNorm and Embedding (not), and a bare parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.conv = torch.nn.Conv1d(WIDTH, WIDTH, 3, padding=1)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, WIDTH)
        self.gate = torch.nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = h + self.down(F.gelu(self.up(self.norm(h)))) * self.gate
        logits = self.head(h).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def build() -> Net:
    """The model, its weights exactly representable in bf16: with `bf16.enabled` DeepSpeed builds its
    fp32 masters from the weights cast to bf16, rayzero from the fp32 weights it was given (more
    precise); equal starting points keep that apart from what a test compares."""
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        for param in net.parameters():
            param.copy_(param.bfloat16().float())
    return net


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator),
            torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator))


@dataclass(frozen=True)
class Run:
    name: str
    config: dict
    steps: int = 6
    rayzero_zero: dict = field(default_factory=dict)
    """zero_optimization items only rayzero gets ("NVME" in a value: a fresh directory)."""
    env: dict = field(default_factory=dict)
    """Environment of the rayzero side for this case (e.g. RAYZERO_OFFLOAD_OVERLAP_STEP)."""
    loss_factor: float = 1.0
    """The loss is multiplied by this (a large one makes fp16 gradients overflow at first)."""


def _train(engine: Any, rank: int, run: Run) -> list[float]:
    losses = []
    for step in range(run.steps):
        loss = engine(*batch(step, rank)) * run.loss_factor
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def deepspeed_side(rank: int, world: int, runs: list[Run]) -> dict:
    import deepspeed

    out: dict = {}
    for run in runs:
        try:
            engine, *_ = deepspeed.initialize(model=build(), config={"steps_per_print": 10**6, **run.config})
            losses = _train(engine, rank, run)
            params = list(engine.module.parameters())
            with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
                weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
            scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)  # torch_autocast float16, stage 0
            scale = float(scaler.get_scale()) if scaler is not None else None
            out[run.name] = {"losses": losses, "weights": weights, "loss_scale": scale}
            engine.destroy()
        except Exception:  # noqa: BLE001 - the case's test reports it
            out[run.name] = {"error": traceback.format_exc()}
    return out


def rayzero_side(rank: int, world: int, runs: list[Run]) -> dict:
    import rayzero

    out: dict = {}
    for run in runs:
        try:
            with mock.patch.dict(os.environ, run.env), tempfile.TemporaryDirectory() as scratch:
                config = dict(run.config)
                zero = {**config.get("zero_optimization", {}), **{
                    key: ({k: (scratch if v == "NVME" else v) for k, v in value.items()}
                          if isinstance(value, dict) else value) for key, value in run.rayzero_zero.items()}}
                config["zero_optimization"] = zero
                model = build()
                engine, *_ = rayzero.initialize(model=model, config=config)
                losses = _train(engine, rank, run)
                optimizer = type(engine.optimizer).__name__
                scale, skipped = float(engine.loss_scaler.loss_scale), engine.skipped_steps
                engine.close()  # stage 3 hands back whole parameters
                weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
                out[run.name] = {"losses": losses, "weights": weights, "optimizer": optimizer,
                                 "loss_scale": scale, "skipped": skipped}
        except Exception:  # noqa: BLE001 - the case's test reports it
            out[run.name] = {"error": traceback.format_exc()}
    return out


def max_rel_diff(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """Over parameters: max |a - b| / max |b| (per tensor: elementwise ratios explode near zero)."""
    assert set(ours) == set(theirs)
    return max(float((ours[n] - theirs[n]).abs().max() / theirs[n].abs().max().clamp_min(1e-12))
               for n in theirs)


def loss_rel_diff(ours: list[float], theirs: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))
