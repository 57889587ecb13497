"""Traffic per optimizer step counted independently of the engine's Communicator: the worker wraps
torch.distributed's collectives before rayzero is imported, so every call the engine makes (through
its comm layer or not) is seen, and the totals are compared with the ZeRO paper's figures derived by
hand for a model whose every size divides by the world size (no padding): Ψ = 280 trainable elements,
stage 0: all-reduce Ψ; stages 1-2: reduce-scatter Ψ + all-gather Ψ; stage 3 (nothing persistent,
nothing kept for reuse): all-gather Ψ in forward + Ψ in backward, reduce-scatter Ψ."""
from __future__ import annotations

import pytest
import torch
from testkit.harness import spawn

pytestmark = pytest.mark.dist

PSI = 8 * 16 + 16 + 16 * 8 + 8  # Linear(8, 16) + Linear(16, 8)
EXPECTED = {
    0: {"all_reduce": PSI},
    1: {"reduce_scatter": PSI, "all_gather": PSI},
    2: {"reduce_scatter": PSI, "all_gather": PSI},
    3: {"all_gather": 2 * PSI, "reduce_scatter": PSI},
}


def _wrap_collectives(seen: list[tuple[str, int]]) -> None:
    import torch.distributed as dist

    def wrap(name: str, measure):
        original = getattr(dist, name, None)
        if original is None:
            return

        def counted(*args, **kwargs):
            seen.append((name, measure(*args, **kwargs)))
            return original(*args, **kwargs)
        setattr(dist, name, counted)

    full = lambda tensor, *a, **k: tensor.numel()  # noqa: E731 - all_reduce / broadcast: the tensor
    for name in ("all_reduce", "broadcast"):
        wrap(name, full)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        wrap(name, lambda output, input, *a, **k: input.numel())
    for name in ("all_gather_single", "all_gather_into_tensor"):
        wrap(name, lambda output, input, *a, **k: output.numel())


def _kind(name: str) -> str:
    return {"reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
            "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather"}.get(name, name)


def _measure(rank: int, world: int, _: object) -> dict:
    seen: list[tuple[str, int]] = []
    _wrap_collectives(seen)  # before rayzero binds any collective
    import rayzero

    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": 100,
                                        "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                                        "stage3_max_live_parameters": 0, "stage3_prefetch_bucket_size": 0}}
        engine, *_ = rayzero.initialize(model=model, config=config)
        per_step = []
        for step in range(3):
            seen.clear()
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            engine.backward(engine(x).square().mean())
            engine.step()
            totals: dict[str, int] = {}
            for name, numel in seen:
                totals[_kind(name)] = totals.get(_kind(name), 0) + numel
            per_step.append((totals, {k: v["elements"] for k, v in engine.comm_stats().items() if k != "total"}))
        engine.close()
        out[stage] = per_step
    return out


def test_traffic_per_step_matches_the_zero_paper_counted_outside_the_engine():
    results = spawn(2, _measure)
    for rank, per_stage in enumerate(results):
        for stage, per_step in per_stage.items():
            for step, (counted, reported) in enumerate(per_step[1:], start=1):  # step 0 may set up plans
                assert counted == EXPECTED[stage], f"rank {rank} stage {stage} step {step}: {counted}"
                # and the engine's own accounting agrees with what torch.distributed saw
                assert {k: v for k, v in reported.items() if k != "control"} == counted
