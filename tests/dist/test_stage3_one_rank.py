"""[Note: modules every rank runs]: at stage 3 a module that runs on one rank only fails fast, on
every rank, with an error naming each rank's module, instead of hanging (NCCL) or aborting the
process (gloo), as DeepSpeed and FSDP2 do; the same model run on every rank trains as usual. When
the forward departs on one rank only later, after the fetch order was recorded, the collectives it
leaves unpaired stall and are named after RAYZERO_STAGE3_STALL_CHECK_S ([Note: stalled stage-3
collectives]) instead of at gloo's timeout."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from testkit import harness as H

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


def _run(rank: int, world: int, diverge: bool | int) -> str:
    """`diverge`: True from the first step, an int from that step on, False never."""
    import rayzero

    torch.manual_seed(0)
    engine, *_ = rayzero.initialize(model=Branchy(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    started = time.monotonic()
    try:
        for step in range(4):
            branch = diverge if isinstance(diverge, bool) else step >= diverge
            engine.backward(engine(torch.randn(2, 16), branch))
            engine.step()
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        if not isinstance(diverge, bool):  # the collectives are unpaired now: no close()
            return f"{type(error).__name__}: {error} after {time.monotonic() - started:.1f} s"
        engine.close()
        return f"{type(error).__name__}: {error}"
    engine.close()
    return "trained"


def test_a_module_run_on_one_rank_only_is_named_on_every_rank() -> None:
    outcomes = H.spawn(2, _run, True, timeout_s=120)
    for outcome in outcomes:
        assert outcome.startswith("RayZeroRuntimeError: stage 3: the ranks fetch different modules"), outcome
        assert "rank 0: only_on_rank_0 (forward)" in outcome and "rank 1: last (forward)" in outcome, outcome


def test_the_same_modules_on_every_rank_train() -> None:
    assert H.spawn(2, _run, False, timeout_s=120) == ["trained", "trained"]


def test_a_module_run_on_one_rank_only_from_a_later_step_is_named_when_the_gathers_stall(monkeypatch) -> None:
    monkeypatch.setenv("RAYZERO_STAGE3_STALL_CHECK_S", "2")  # inherited by the spawned ranks
    outcomes = H.spawn(2, _run, 2, timeout_s=120)
    for outcome in outcomes:
        assert outcome.startswith("RayZeroRuntimeError: stage 3: the ranks fetch different modules"), outcome
        # rank 1 skipped it: its message says where it left the order both ranks recorded
        assert "left its recorded order at last (forward) where only_on_rank_0 (forward) came before" in outcome


class Sleepy(Branchy):
    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        x = self.first(x)
        if step == 2 and dist.get_rank() == 1:
            time.sleep(3)  # a slow rank, not a divergent one: its peer's gather waits past the check
        return self.last(self.only_on_rank_0(x)).square().mean()


def _run_slow(rank: int, world: int, payload: None) -> str:
    import rayzero

    torch.manual_seed(0)
    engine, *_ = rayzero.initialize(model=Sleepy(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    for step in range(4):
        engine.backward(engine(torch.randn(2, 16), step))
        engine.step()
    engine.close()
    return "trained"


def test_a_rank_that_is_only_slow_is_not_mistaken_for_a_divergent_one(monkeypatch) -> None:
    monkeypatch.setenv("RAYZERO_STAGE3_STALL_CHECK_S", "1")
    assert H.spawn(2, _run_slow, None, timeout_s=120) == ["trained", "trained"]
