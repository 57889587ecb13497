"""A checkpoint taken at one gradient accumulation resumes at another on an accumulation boundary
(what an elastic resize does: same global batch, other world size, other gas)."""
from __future__ import annotations

import pytest
import torch

import rayzero

pytestmark = pytest.mark.unit


def _engine(gas: int):
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "checkpoint": {"async_save": False}}
    engine, _, _, _ = rayzero.initialize(model=torch.nn.Linear(4, 1), config=config)
    return engine


def _micro_step(engine) -> bool:
    """One micro batch; True when it ended an optimizer step."""
    before = engine.global_steps
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    return engine.global_steps > before


def test_resume_at_another_gas_starts_a_full_accumulation_window(tmp_path):
    first = _engine(gas=2)
    for _ in range(6):  # 3 optimizer steps, 6 micro steps
        _micro_step(first)
    first.save_checkpoint(str(tmp_path))
    first.wait_for_checkpoint()
    resumed = _engine(gas=3)
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.global_steps == 3
    # 6 saved micro steps are no boundary at gas 4: without realigning, the first window would be 2 long
    again = _engine(gas=4)
    again.load_checkpoint(str(tmp_path))
    assert [_micro_step(again) for _ in range(4)] == [False, False, False, True]
    assert [_micro_step(resumed) for _ in range(3)] == [False, False, True]
