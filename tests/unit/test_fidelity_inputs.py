"""Inputs reach the model as DeepSpeed passes them: cast to fp16 only with `fp16.auto_cast` (floating
positional tensors, nested containers too), never under bf16, never keyword arguments."""
from __future__ import annotations

import pytest
import torch

import rayzero

pytestmark = pytest.mark.unit


class Recorder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.seen: list = []

    def forward(self, x, pair, target=None):
        self.seen = [x.dtype, pair[0].dtype, pair[1].dtype, None if target is None else target.dtype]
        return (x.float() * self.weight.float()).sum()


@pytest.mark.parametrize("precision, auto_cast, expected_x", [
    ("fp16", True, torch.float16), ("fp16", False, torch.float32), ("bf16", False, torch.float32),
])
def test_inputs_are_cast_only_with_fp16_auto_cast(precision, auto_cast, expected_x):
    model = Recorder()
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "fp16": {"enabled": precision == "fp16", "auto_cast": auto_cast},
              "bf16": {"enabled": precision == "bf16"}}
    engine, *_ = rayzero.initialize(model=model, config=config)
    try:
        engine(torch.ones(3), (torch.ones(3), torch.arange(3)), target=torch.ones(3))
        assert model.seen == [expected_x, expected_x, torch.int64, torch.float32]  # kwargs and ints untouched
    finally:
        engine.close()
