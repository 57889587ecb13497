"""[Note: partitioned construction]: only parameters are stand-ins on the meta device, so what a
constructor computes into a buffer keeps its value under rayzero.zero.Init (as under DeepSpeed's
Init, which builds buffers normally). The oracle is the same module built without Init."""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.dist


class Sinusoidal(torch.nn.Module):
    """A positional table computed in __init__ (no reset_parameters can recompute it)."""

    def __init__(self, length: int = 16, width: int = 8) -> None:
        super().__init__()
        position = torch.arange(length).unsqueeze(1)
        scale = torch.exp(torch.arange(0, width, 2) * (-math.log(10000.0) / width))
        table = torch.zeros(length, width)
        table[:, 0::2], table[:, 1::2] = torch.sin(position * scale), torch.cos(position * scale)
        self.register_buffer("table", table, persistent=False)
        self.register_buffer("causal", torch.tril(torch.ones(length, length, dtype=torch.bool)))
        self.proj = torch.nn.Linear(width, width)


def test_constructor_computed_buffers_keep_their_values():
    import rayzero
    from rayzero.zero import GatheredParameters

    torch.manual_seed(3)
    plain = Sinusoidal()
    torch.manual_seed(3)
    with rayzero.zero.Init(config={"zero_optimization": {"stage": 3}}):
        built = Sinusoidal()
    assert torch.equal(built.table, plain.table) and torch.equal(built.causal, plain.causal)
    with GatheredParameters(list(built.parameters())):  # and the parameters as a plain build's
        assert torch.equal(built.proj.weight.detach(), plain.proj.weight.detach())
        assert torch.equal(built.proj.bias.detach(), plain.proj.bias.detach())
