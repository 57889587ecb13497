"""`data_types.grad_accum_dtype: "fp32"` under bf16 at ZeRO stages 0 and 1 (DeepSpeed's BF16_Optimizer):
each micro step's bf16 gradients are summed in fp32 across the accumulation window, not in bf16
([Note: fp32 gradient accumulation] in rayzero/engine/bucketed/strategy.py).

The oracle is computed by hand in one process: a bf16 copy of the model runs every rank's micro
batches one by one; each micro step's bf16 gradients (of the loss divided by gas × world, as the
engine scales it) are cast to fp32 and added in micro-step order, then summed over ranks. One SGD
step with lr 1 (fp32 reductions, no clipping, no decay) turns that sum into `master - sum`, which the
engine must reproduce bit for bit; with the default (bf16) accumulation it must not."""
from __future__ import annotations

import pytest
import torch
from testkit.harness import assemble_masters, build_model, global_batch, master_pieces, spawn

pytestmark = pytest.mark.dist

WORLD, GAS, MICRO = 2, 4, 2
STAGES = (0, 1)
MODES = ("fp32", None)  # grad_accum_dtype asked, or DeepSpeed's default (the compute dtype)


class _Pieces:  # assemble_masters reads `.masters`
    def __init__(self, masters: list) -> None:
        self.masters = masters


def _micro_window(step_micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = global_batch(0, WORLD * GAS * MICRO)
    start = (step_micro * WORLD + rank) * MICRO
    return tokens[start:start + MICRO], targets[start:start + MICRO]


def _train(rank: int, world: int, payload: None) -> dict:
    import rayzero

    results = {}
    for stage in STAGES:
        for mode in MODES:
            config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
                      "gradient_clipping": 0.0, "bf16": {"enabled": True}, "communication_data_type": "fp32",
                      "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
                      "optimizer": {"type": "SGD", "params": {"lr": 1.0}}}
            if mode is not None:
                config["data_types"] = {"grad_accum_dtype": mode}
            engine, _, _, _ = rayzero.initialize(model=build_model(), config=config)
            for micro in range(GAS):
                engine.backward(engine(*_micro_window(micro, rank)))
                engine.step()
            results[(stage, mode)] = master_pieces(engine)
            engine.close()
    return results


def _hand_reference() -> dict[str, torch.Tensor]:
    """master - Σ_rank Σ_micro fp32(bf16 gradient), accumulated as DeepSpeed's BF16_Optimizer does."""
    model = build_model()
    start = {n: p.detach().clone().reshape(-1) for n, p in model.named_parameters() if p.requires_grad}
    low = build_model().to(torch.bfloat16)
    total: dict[str, torch.Tensor] = {}
    for rank in range(WORLD):
        window: dict[str, torch.Tensor] = {}
        for micro in range(GAS):
            low.zero_grad(set_to_none=True)
            (low(*_micro_window(micro, rank)).float() / (GAS * WORLD)).backward()
            for name, param in low.named_parameters():
                if param.grad is not None:
                    grad = param.grad.float().reshape(-1)
                    window[name] = window[name].add_(grad) if name in window else grad.clone()
        for name, grad in window.items():
            total[name] = total[name] + grad if name in total else grad
    return {name: start[name].add(total.get(name, torch.zeros_like(start[name])), alpha=-1.0) for name in start}


def test_fp32_accumulation_of_bf16_gradients_at_stages_0_and_1_is_exact():
    per_rank = spawn(WORLD, _train)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (harness.gloo_init): the same reduction order in LayerNorm's backward
    try:
        expected = _hand_reference()
    finally:
        torch.set_num_threads(threads)
    for stage in STAGES:
        for mode in MODES:
            full = assemble_masters([_Pieces(result[(stage, mode)]) for result in per_rank])
            differing = [n for n in expected if not torch.equal(full[n], expected[n])]
            if mode == "fp32":
                assert not differing, f"stage {stage}: fp32 accumulation differs from the hand sum in {differing}"
            else:  # bf16 accumulation rounds each partial sum: the oracle can tell the two apart
                assert differing, f"stage {stage}: bf16 accumulation gave the fp32 sums"
