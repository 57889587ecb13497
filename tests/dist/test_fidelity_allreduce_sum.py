"""`gradient_allreduce_op: "sum"` (DeepSpeed's key, stages 0-2): the ranks' gradients are added, not
averaged, so at 2 ranks every SGD update is twice the averaged one. The reference is a single
process whose loss is the world size times the global-batch mean (each rank's micro-batch mean,
summed), with gradient accumulation 2; SGD, because Adam's update hardly moves when every gradient
is scaled by the same factor."""
from __future__ import annotations

import pytest
import torch

from tests.dist.harness import LR, assemble_masters, build_model, global_batch, max_rel_diff, spawn

pytestmark = pytest.mark.dist

STEPS, MICRO, GAS = 4, 2, 2
STAGES = (0, 1, 2)
OPS = ("sum", "mean")


def _train(rank: int, world: int, payload: dict) -> dict:
    import rayzero

    results = {}
    for stage in STAGES:
        for op in OPS:
            config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
                      "gradient_clipping": 0.0, "gradient_allreduce_op": op,
                      "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
                      "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}}
            engine, _, _, _ = rayzero.initialize(model=build_model(), config=config)
            for step in range(STEPS):
                for micro in range(GAS):
                    tokens, targets = global_batch(step * GAS + micro, world * MICRO)
                    window = slice(rank * MICRO, (rank + 1) * MICRO)
                    engine.backward(engine(tokens[window], targets[window]))
                    engine.step()
            results[(stage, op)] = [
                (s.spec.name[len("master/"):], s.spec.global_shape, s.spec.flat_start, s.spec.flat_end,
                 s.local.detach().clone()) for s in engine.state_shards() if s.spec.name.startswith("master/")]
            engine.close()
    return results


class _Pieces:  # assemble_masters reads `.masters`
    def __init__(self, masters: list) -> None:
        self.masters = masters


def _reference(world: int, loss_factor: float) -> dict[str, torch.Tensor]:
    model = build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
    for step in range(STEPS):
        for micro in range(GAS):
            tokens, targets = global_batch(step * GAS + micro, world * MICRO)
            (model(tokens, targets) * loss_factor / GAS).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone().reshape(-1) for n, p in model.named_parameters() if p.requires_grad}


def test_summed_gradients_match_deepspeeds_sum_at_stages_0_to_2():
    world = 2
    per_rank = spawn(world, _train)
    expected = {"sum": _reference(world, float(world)), "mean": _reference(world, 1.0)}
    used = [n for n in expected["sum"] if n != "unused"]
    # the two reductions differ visibly on this model, so matching one is not matching both
    assert max(max_rel_diff(expected["sum"][n], expected["mean"][n]) for n in used) > 1e-3
    for stage in STAGES:
        for op, reference in expected.items():
            full = assemble_masters([_Pieces(result[(stage, op)]) for result in per_rank])
            worst = max(max_rel_diff(full[n], reference[n]) for n in used)
            assert worst <= 1e-5, f"stage {stage} gradient_allreduce_op={op}: parameters differ by {worst:.2e}"
