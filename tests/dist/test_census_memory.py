"""Bytes of model state per parameter per rank against the ZeRO formula (issue 37 item 4), counted
from the outside: a census of every live tensor storage (bench/census.py: the garbage collector's
tensors, the module's parameters, buffers and gradients, every optimizer's state; storages counted
once), never the engine's own counters.

The formula (ZeRO paper, section 5; DeepSpeed's estimators), per rank and trainable parameter, with
N ranks and Adam:
                 bf16 (mixed precision, K = 12)      fp32 (the parameters are the masters, K = 8)
    stage 0      2 + 2 + 12                          4 + 4 + 8
    stage 1      2 + 2 + 12/N                        4 + 4 + 8/N
    stage 2      2 + (2 + 12)/N                      4 + (4 + 8)/N
    stage 3      (2 + 2 + 12)/N                      (4 + 4 + 8)/N
bf16: 2 bytes of compute parameter, 2 of gradient, K = 4 (fp32 master) + 8 (Adam's two fp32
moments). At stage 3 the 16/N is also FSDP2's layout: an fp32 sharded parameter that is the
master, an fp32 gradient shard, Adam's state; no persistent bf16 copy of the shard (bf16 exists
only gathered, while a module runs). fp32: a separate fp32 master would be a second copy of the
parameters and is counted against the engine.

The census is taken after two steps, between the third step's backward and its optimizer step:
gradients are held, and optimizer state exists since the first step. Allowed beside the formula
(the paper's "constant-size buffers"): two gradient buckets in fp32 (stage 2's staging pair; a
bucket is `reduce_bucket_size` elements, or one parameter larger than that), and SLACK bytes per
parameter for padding and the batch. Activations are gone by then (backward has run). The model is
a stack of many small layers, so those buffers are small beside it, as in a real model.

FSDP2 (`fully_shard` per layer; bf16: bf16 compute parameters, fp32 reduction) is measured by the
same census at its one stage, 3: it meets the formula, so the census and the formula are sound
and a rayzero case that misses it misses a layout that exists.

Cases that miss the formula today are marked xfail(strict) with what they hold beyond it
(FAILS_TODAY): once the engine meets the formula the mark fails the test, and the mark goes.
"""
from __future__ import annotations

import gc

import pytest
import torch
from testkit.harness import spawn

from bench import census

pytestmark = pytest.mark.dist

VOCAB, WIDTH, HIDDEN, LAYERS = 257, 127, 255, 16  # ~1.1M parameters; odd sizes: shards need padding
REDUCE_BUCKET = 20_000
"""reduce / all-gather / prefetch bucket elements: small beside the model, as in a real one."""
SLACK = 0.1
"""Bytes per parameter allowed beyond the formula and the bucket buffers (padding, the batch)."""
STEPS = 2
"""Steps before the census: optimizer state exists from the first."""


class Tower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, WIDTH))
            for _ in range(LAYERS))
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for layer in self.layers:
            hidden = hidden + layer(hidden)
        return torch.nn.functional.cross_entropy(self.head(hidden).float().flatten(0, 1), targets.flatten())


def formula(stage: int, precision: str, world: int) -> float:
    """Bytes per parameter per rank (module docstring)."""
    param, grad, state = (2, 2, 12) if precision == "bf16" else (4, 4, 8)
    return {0: param + grad + state, 1: param + grad + state / world, 2: param + (grad + state) / world,
            3: (param + grad + state) / world}[stage]


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=generator)
    return tokens, torch.randint(0, VOCAB, (2, 8), generator=generator)


def _rayzero(model: torch.nn.Module, stage: int, precision: str):
    import rayzero

    zero = {"stage": stage, "reduce_bucket_size": REDUCE_BUCKET}
    if stage == 3:  # every parameter partitioned (the formula's), gathered in buckets as small
        zero.update(stage3_prefetch_bucket_size=REDUCE_BUCKET, stage3_param_persistence_threshold=0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "zero_optimization": zero}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = rayzero.initialize(model=model, config=config)

    def step(tokens, targets, between):
        loss = engine(tokens, targets)
        engine.backward(loss)
        between()
        engine.step()
    return step, engine.close


def _fsdp2(model: torch.nn.Module, stage: int, precision: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def step(tokens, targets, between):
        model(tokens, targets).backward()
        between()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step, lambda: None


def _census(rank: int, system: str, stage: int, precision: str) -> dict:
    """One case's census, in bytes per parameter (total, and by kind/dtype)."""
    baseline = census.take()  # what is alive before the case (kept alive: no address is reused)
    torch.manual_seed(0)
    model = Tower()
    parameters = sum(p.numel() for p in model.parameters())
    step, close = (_rayzero if system == "rayzero" else _fsdp2)(model, stage, precision)
    for index in range(STEPS):
        step(*_batch(index, rank), lambda: None)
    taken = []
    step(*_batch(STEPS, rank), lambda: taken.append(census.take([model], baseline)))
    close()
    return {"bytes_per_param": taken[0].total / parameters,
            "by_kind_dtype": {k: round(v / parameters, 3) for k, v in taken[0].by_kind_dtype.items() if v}}


def _censuses(rank: int, world: int, cases: list[tuple[str, int, str]]) -> dict:
    results = {}
    for case in cases:
        results[case] = _census(rank, *case)
        gc.collect()  # the case's engine and model, before the next case's baseline
    return results


RAYZERO = [("rayzero", stage, precision) for precision in ("fp32", "bf16") for stage in range(4)]
FSDP2 = [("fsdp2", 3, precision) for precision in ("fp32", "bf16")]


@pytest.fixture(scope="module")
def measured() -> dict:
    """Every case at 1 and 2 ranks (one process group per world size); of two ranks, the one
    holding more (shards of uneven size)."""
    out = {}
    for world in (1, 2):
        by_rank = spawn(world, _censuses, RAYZERO + FSDP2, timeout_s=1800)
        out[world] = {case: max((rank[case] for rank in by_rank), key=lambda r: r["bytes_per_param"])
                      for case in by_rank[0]}
    return out


# What each case missing the formula holds beyond it (bytes per parameter, the census's kind/dtype
# columns, measured 2026-11-28 after main's stage-3 [Note: shards are the masters]): (stage,
# precision) -> why, at both world sizes. Stage 3 bf16 meets the formula since that note (its bf16
# shard was a second copy beside the fp32 master, +2/N: 18.0 against 16 on 1 rank, 9.0 against 8 on 2).
FAILS_TODAY = {
    (0, "bf16"): "a full fp32 gradient (the master gradient, 'other/float32' 8 = it and the fp32 master) beside "
                 "the bf16 gradient buffer: 20.0 against 16 on 1 and 2 ranks",
    (1, "bf16"): "an fp32 gradient shard beside the full bf16 gradient buffer, +4/N: 20.0 against 16 (1 rank), "
                 "12.0 against 10 (2 ranks)",
    (2, "bf16"): "an fp32 gradient shard (4/N) where the formula has a bf16 one (2/N), +2/N (the staging pair, "
                 "+0.12 as uint8, is within the allowance): 18.1 against 16 (1 rank), 10.1 against 9 (2 ranks)",
}


def _marks(system: str, stage: int, precision: str) -> tuple:
    reason = FAILS_TODAY.get((stage, precision)) if system == "rayzero" else None
    return (pytest.mark.xfail(strict=True, reason=f"holds {reason}"),) if reason else ()


CASES = [pytest.param(world, system, stage, precision, id=f"{system}-stage{stage}-{precision}-{world}rank",
                      marks=_marks(system, stage, precision))
         for world in (1, 2) for system, stage, precision in RAYZERO + FSDP2]


@pytest.mark.parametrize("world,system,stage,precision", CASES)
def test_model_state_bytes_per_parameter_meet_the_zero_formula(measured, world, system, stage, precision):
    found = measured[world][(system, stage, precision)]
    model = Tower()
    parameters = sum(p.numel() for p in model.parameters())
    bucket_buffers = 2 * max(REDUCE_BUCKET, *(p.numel() for p in model.parameters())) * 4
    expected = formula(stage, precision, world)
    allowed = expected + bucket_buffers / parameters + SLACK
    figures = (f"{system} stage {stage} {precision} on {world} rank(s): {found['bytes_per_param']:.3f} bytes/param "
               f"against the formula's {expected:.3f} (+{allowed - expected:.3f} allowed); census by "
               f"kind/dtype: {found['by_kind_dtype']}")
    # Below the formula no engine can be without offload: the census would be missing tensors.
    assert found["bytes_per_param"] >= expected - SLACK, figures
    assert found["bytes_per_param"] <= allowed, figures
