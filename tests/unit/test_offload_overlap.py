"""[Note: step overlapped with backward] in a world of one: with CPU offload at stages 1-2 the
optimizer steps each bucket while backward goes on, with the same result bit for bit as the step
after backward (the oracle: the same run with RAYZERO_OFFLOAD_OVERLAP_STEP=0, and the run without
offload); it stays off where the math needs every gradient first (clipping, fp16); a second
boundary backward before `step()` is refused instead of stepping twice (issue 9)."""
from __future__ import annotations

import pytest
import torch

import rayzero
from rayzero.config.errors import RayZeroRuntimeError, RayZeroValueError

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _overlap_on_cpu(monkeypatch):
    """On a CPU-only machine the overlap is off by default (it competes with backward for the
    cores); these tests turn it on to run the path."""
    monkeypatch.setenv("RAYZERO_OFFLOAD_OVERLAP_STEP", "1")


def _engine(stage: int, offload: str, clipping: float = 0.0, gas: int = 2, **extra):
    """Six layers; stages 1-2 in buckets of about one layer, stage 3 in sub-groups of about one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
              "gradient_clipping": clipping,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 1500, "sub_group_size": 1100,
                                    "offload_optimizer": {"device": offload}}, **extra}
    return rayzero.initialize(model=model, config=config)[0], model


def _train(engine, model, steps: int = 4) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps * engine.gradient_accumulation_steps()):
        loss = engine(torch.randn(4, 32, generator=generator)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    out = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    engine.close()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overlapped_step_is_bitwise_the_step_after_backward(stage: int, monkeypatch) -> None:
    engine, model = _engine(stage, "cpu")
    pieces = engine.strategy.groups if stage == 3 else engine.strategy.buckets
    assert len(pieces) > 2, "several buckets / sub-groups, so some step while backward runs"
    overlapped = _train(engine, model)
    parts = {"cpu_step", "cpu_step_exposed"} | ({"d2h", "h2d_publish"} if stage < 3 else set())
    assert set(engine.offload_breakdown()) == parts
    monkeypatch.setenv("RAYZERO_OFFLOAD_OVERLAP_STEP", "0")
    after = _train(*_engine(stage, "cpu"))
    plain = _train(*_engine(stage, "none"))
    assert torch.equal(overlapped, after) and torch.equal(overlapped, plain)


def test_clipping_keeps_the_step_after_backward() -> None:
    engine, model = _engine(2, "cpu", clipping=1.0)
    _train(engine, model, steps=1)
    assert set(engine.offload_breakdown()) == {"cpu_step", "d2h", "h2d_publish"}


def test_wall_clock_breakdown_logs_the_offloaded_step_parts(caplog) -> None:
    engine, model = _engine(1, "cpu", wall_clock_breakdown=True)
    with caplog.at_level("INFO", logger="rayzero.engine.engine"):
        _train(engine, model, steps=2)
    lines = [r.getMessage() for r in caplog.records if "time (ms)" in r.getMessage()]
    assert lines and all(f"offload_{part}:" in lines[-1] for part in ("cpu_step", "cpu_step_exposed", "d2h",
                                                                    "h2d_publish")), lines


def test_second_boundary_backward_before_step_is_refused() -> None:
    engine, _ = _engine(1, "cpu", gas=1)
    x = torch.randn(4, 32)
    engine.backward(engine(x).pow(2).mean())
    with pytest.raises(RayZeroRuntimeError, match=r"before engine.step\(\)"):
        engine.backward(engine(x).pow(2).mean())
    engine.close()


def test_a_learning_rate_set_after_backward_is_refused_not_applied_late() -> None:
    """The early step used the old lr; applying the new one a step late would change the math."""
    engine, _ = _engine(1, "cpu", gas=1)
    engine.backward(engine(torch.randn(4, 32)).pow(2).mean())
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.5
    with pytest.raises(RayZeroRuntimeError, match=r"param group 0: lr changed between engine.backward\(\)"):
        engine.step()
    engine.close()


def test_a_learning_rate_set_before_backward_is_used() -> None:
    engine, model = _engine(1, "cpu", gas=1)
    before = [p.detach().clone() for p in model.parameters()]
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0  # the top of the iteration, as nanoGPT-style loops set it
    engine.backward(engine(torch.randn(4, 32)).pow(2).mean())
    engine.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "lr 0 and no weight decay: no change"
    engine.close()


def test_on_a_cpu_only_machine_the_step_stays_after_backward_by_default(monkeypatch) -> None:
    """`auto`: the thread would compete with backward for the same cores (measured slower)."""
    monkeypatch.delenv("RAYZERO_OFFLOAD_OVERLAP_STEP")
    engine, model = _engine(2, "cpu")
    _train(engine, model, steps=1)
    assert set(engine.offload_breakdown()) == {"cpu_step", "d2h", "h2d_publish"}
    monkeypatch.setenv("RAYZERO_OFFLOAD_OVERLAP_STEP", "sometimes")
    with pytest.raises(RayZeroValueError, match="RAYZERO_OFFLOAD_OVERLAP_STEP='sometimes': use auto, 1 or 0"):
        _engine(2, "cpu")
