"""[Note: modules every rank runs]: at stage 3 a module that runs on one rank only fails fast, on
every rank, with an error naming each rank's module, instead of hanging (NCCL) or aborting the
process (gloo), as DeepSpeed and FSDP2 do; the same model run on every rank trains as usual."""
from __future__ import annotations

import harness as H
import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.dist


class Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(16, 16)
        self.only_on_rank_0 = torch.nn.Linear(16, 16)
        self.last = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, diverge: bool) -> torch.Tensor:
        x = self.first(x)
        if not diverge or dist.get_rank() == 0:
            x = self.only_on_rank_0(x)
        return self.last(x).square().mean()


def _run(rank: int, world: int, diverge: bool) -> str:
    import rayzero

    torch.manual_seed(0)
    engine, *_ = rayzero.initialize(model=Branchy(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    try:
        for _ in range(3):
            engine.backward(engine(torch.randn(2, 16), diverge))
            engine.step()
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return f"{type(error).__name__}: {error}"
    finally:
        engine.close()
    return "trained"


def test_a_module_run_on_one_rank_only_is_named_on_every_rank() -> None:
    outcomes = H.spawn(2, _run, True, timeout_s=120)
    for outcome in outcomes:
        assert outcome.startswith("RayZeroRuntimeError: stage 3: the ranks fetch different modules"), outcome
        assert "rank 0: only_on_rank_0 (forward)" in outcome and "rank 1: last (forward)" in outcome, outcome


def test_the_same_modules_on_every_rank_train() -> None:
    assert H.spawn(2, _run, False, timeout_s=120) == ["trained", "trained"]
