"""Stage 0-3 robustness users notice (issue 12 item 4), on 2 gloo ranks:
- a second `rayzero.initialize` on a model a live engine wraps is refused naming `engine.close()`;
  after `close()` the model (trained weights, gathered at stage 3) can be wrapped again;
- DeepSpeed's unused-parameter semantics: a parameter no rank used in a step gets a zero gradient
  (so AdamW still decays it and its momentum still moves it), one used on some ranks only is
  averaged with the others' zeros.
The references are single-process torch with those semantics written out, not the engine.
"""
from __future__ import annotations

import pytest
import torch
from testkit.harness import max_rel_diff, spawn

pytestmark = pytest.mark.dist

STAGES = (0, 1, 2, 3)
ZERO = {"reduce_bucket_size": 50, "stage3_param_persistence_threshold": 0}


class Uneven(torch.nn.Module):
    """`used_once` only in step 0, `never` never, `rank0_only` only in rank 0's forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 6)
        self.used_once = torch.nn.Parameter(torch.randn(6))
        self.never = torch.nn.Parameter(torch.randn(5))
        self.rank0_only = torch.nn.Parameter(torch.randn(6) * 0.1)

    def forward(self, x: torch.Tensor, step: int, rank: int) -> torch.Tensor:
        h = self.lin(x)
        if step == 0:
            h = h + self.used_once
        if rank == 0:
            h = h * (1 + self.rank0_only)
        return h.square().mean()


def _data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _config(stage: int, optimizer: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "optimizer": optimizer,
            "zero_optimization": {"stage": stage, **ZERO}}


ADAMW = {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.1}}
SGD = {"type": "SGD", "params": {"lr": 0.1}}


def _workers(rank: int, world: int, _: object) -> dict:
    import rayzero

    out: dict = {}
    for stage in STAGES:
        # unused parameters
        model = Uneven()
        engine, *_ = rayzero.initialize(model=model, config=_config(stage, ADAMW))
        for step in range(4):
            engine.backward(engine(_data(step, rank), step, rank))
            engine.step()
        engine.close()  # stage 3 hands back gathered parameters
        out[("unused", stage)] = {n: p.detach().clone() for n, p in model.named_parameters()}

        # a second initialize
        model = Uneven()
        engine, *_ = rayzero.initialize(model=model, config=_config(stage, SGD))
        for step in range(2):
            engine.backward(engine(_data(step, rank), step, rank))
            engine.step()
        refusals = []
        for target in (model, model.lin):
            try:
                rayzero.initialize(model=target, config=_config(stage, SGD))
            except ValueError as error:
                refusals.append(str(error))
        engine.close()
        again, *_ = rayzero.initialize(model=model, config=_config(stage, SGD))
        again.backward(again(_data(2, rank), 2, rank))
        again.step()
        again.close()
        out[("rewrap", stage)] = {"refusals": refusals,
                                  "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return out


def _reference(optimizer_class: type, steps: int, world: int, **kwargs: object) -> dict[str, torch.Tensor]:
    """DeepSpeed's semantics by hand: mean of the ranks' gradients, zeros for a parameter no rank used."""
    model = Uneven()
    optimizer = optimizer_class(model.parameters(), **kwargs)
    for step in range(steps):
        loss = sum(model(_data(step, rank), step, rank) for rank in range(world)) / world
        loss.backward()
        for param in model.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_unused_parameters_and_a_second_initialize_at_every_stage():
    world = 2
    results = spawn(world, _workers)
    adamw = _reference(torch.optim.AdamW, 4, world, lr=0.05, weight_decay=0.1)
    untouched = dict(Uneven().named_parameters())
    # the semantics differ visibly from torch's skip-when-None: `never` decays, `used_once` keeps moving
    assert not torch.allclose(adamw["never"], untouched["never"])
    sgd = _reference(torch.optim.SGD, 3, world, lr=0.1)
    for stage in STAGES:
        for rank in range(world):
            got = results[rank][("unused", stage)]
            for name, expected in adamw.items():
                assert max_rel_diff(got[name], expected) <= 1e-5, f"stage {stage} rank {rank} `{name}`"
            rewrap = results[rank][("rewrap", stage)]
            assert len(rewrap["refusals"]) == 2, f"stage {stage}: both re-wraps must be refused"
            assert all("engine.close()" in text for text in rewrap["refusals"])
            assert "already wrapped by" in rewrap["refusals"][0]
            assert "part of a model wrapped by" in rewrap["refusals"][1]
            for name, expected in sgd.items():
                assert max_rel_diff(rewrap["params"][name], expected) <= 1e-5, f"stage {stage} rewrap `{name}`"
