"""The engine on CUDA with NCCL: stages 0-3 train like single-process fp32 torch on the same GPU.

One spawned NCCL group of one rank (env: RANK=0, WORLD_SIZE=1, `rayzero.init_distributed`) runs
every case; with two or more GPUs a 2-rank NCCL group runs them again. The model, data and
tolerances are those of tests/dist/test_parity.py (fp32 ≤ 1e-5 relative; bf16 losses ≤ 1e-2
relative and parameters ≤ 0.05 absolute — bf16 rounding, justified in that file's docstring).
fp16 with dynamic loss scaling must skip the overflowing steps; `memory_stats()` must report the
CUDA allocator's peak. Rank code: tests/gpu/cuda_workers.py.
"""
from __future__ import annotations

import functools

import cuda_workers as W
import pytest
import torch
from testkit import harness as H

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (torch.cuda.is_available() is False): run tests/gpu on a GPU machine")

# gas 1 runs AdamW with clipping (checks the global norm), gas 2 SGD without (checks 1/world, 1/gas).
CASES = [H.Case(stage=s, precision=p, gas=g, optimizer="adamw" if g == 1 else "sgd")
         for s in (0, 1, 2, 3) for p in ("fp32", "bf16") for g in (1, 2)]
_NVME = __import__("tempfile").mkdtemp(prefix="rayzero-gpu-nvme-")
# Offload (issue 9): masters and optimizer state in pinned host memory / NVMe, the step on the CPU.
CASES += [H.Case(stage=s, gas=2, optimizer="sgd" if s == 1 else "adamw",
                 zero=(("offload_optimizer", {"device": "cpu", "pin_memory": True}),)) for s in (1, 2, 3)]
# stage 2 SGD has no clipping: its CPU step runs bucket by bucket during backward; ratio 0.5 at
# stage 3 keeps half of the sub-groups on the GPU ([Note: partial offload]).
CASES += [H.Case(stage=2, gas=2, optimizer="sgd",
                 zero=(("offload_optimizer", {"device": "cpu", "pin_memory": True}), ("reduce_bucket_size", 100))),
          H.Case(stage=3, gas=2, optimizer="sgd",
                 zero=(("offload_optimizer", {"device": "cpu", "pin_memory": True}), ("sub_group_size", 300))),
          H.Case(stage=3, gas=2, zero=(("offload_optimizer", {"device": "cpu", "pin_memory": True, "ratio": 0.5}),
                                       ("sub_group_size", 300)))]
CASES += [H.Case(stage=3, gas=2, zero=(("offload_optimizer", {"device": "nvme", "nvme_path": _NVME,
                                                              "pipeline_read": True, "pipeline_write": True}),
                                       ("offload_param", {"device": "cpu", "pin_memory": True}),
                                       ("sub_group_size", 1000))),
          # parameter shards on NVMe too, every one swapped: read into staging buffers, copied to the GPU
          H.Case(stage=3, gas=2, zero=(("offload_optimizer", {"device": "cpu", "pin_memory": True}),
                                       ("offload_param", {"device": "nvme", "nvme_path": _NVME, "max_in_cpu": 0,
                                                          "buffer_count": 2})))]
FP16_CASES = [H.Case(stage=s, precision="fp16", steps=12, extra=W.FP16_EXTRA) for s in (0, 3)]
ALL_CASES = CASES + FP16_CASES


def _case_id(case: H.Case) -> str:
    offload = "".join(f"-{key}={value['device']}" for key, value in case.zero if key.startswith("offload"))
    return f"stage{case.stage}-{case.precision}-gas{case.gas}-{case.optimizer}{offload}"


@functools.cache
def _spawned(world: int) -> dict:
    """One spawned NCCL group's results, or {"error": why it produced none}: cached either way, so
    a group that fails is not spawned again by each test."""
    try:
        return {"per_rank": W.spawn(world, W.run_cases, ALL_CASES)}
    except RuntimeError as error:
        return {"error": str(error)}


def group_results(world: int) -> dict:
    """{"results": [per case: [per rank]], "references": {...}} from one spawned NCCL group."""
    spawned = _spawned(world)
    if "error" in spawned:
        pytest.fail(f"the {world}-rank NCCL group failed: {spawned['error'][-3000:]}")
    per_rank = spawned["per_rank"]
    return {"results": [[per_rank[r]["results"][i] for r in range(world)] for i in range(len(ALL_CASES))],
            "references": per_rank[0]["references"]}


def _ok(result: dict) -> dict:
    assert "error" not in result, f"the case raised:\n{result['error']}"
    return result


def _check_parity(world: int, index: int) -> None:
    case = CASES[index]
    out = group_results(world)
    per_rank = out["results"][index]
    assert all(r["backend"] == "nccl" and r["device"].startswith("cuda") for r in per_rank)
    W.compare(case, per_rank, out["references"][W.reference_key(case)])


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_one_gpu_matches_the_fp32_cuda_reference(index: int) -> None:
    _check_parity(1, index)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a 2-rank NCCL group needs 2 GPUs")
@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_two_gpus_match_the_fp32_cuda_reference(index: int) -> None:
    _check_parity(2, index)


@pytest.mark.parametrize("stage", [0, 3])
def test_fp16_dynamic_loss_scaling_skips_overflow_steps(stage: int) -> None:
    index = len(CASES) + [case.stage for case in FP16_CASES].index(stage)
    result = _ok(group_results(1)["results"][index][0])
    steps = result["steps"]
    assert steps[0]["skipped"] and steps[0]["unchanged"], "2^18 overflows fp16: the first step is skipped"
    assert steps[0]["scale_after"] == steps[0]["scale_before"] / 2, "and the loss scale is halved"
    taken = [s for s in steps if not s["skipped"]]
    assert taken and all(not s["unchanged"] for s in taken), "once the scale fits, steps update weights"
    assert result["skipped_steps"] == sum(s["skipped"] for s in steps) >= 1
    assert not steps[-1]["skipped"] and steps[-1]["scale_after"] < 2**18
    assert all(torch.isfinite(torch.tensor(result["losses"][-3:]))), "training goes on with finite losses"


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_memory_stats_report_the_cuda_allocator_peak(index: int) -> None:
    result = _ok(group_results(1)["results"][index][0])
    memory = result["memory"]
    assert "peak_device_allocated" in memory, "memory_stats() reports the device peak on CUDA"
    # read by memory_stats() just before the worker read the allocator itself: nothing ran between
    assert memory["peak_device_allocated"] == result["allocator_peak"]
    assert memory["peak_device_allocated"] >= memory["model_state"] > 0, "the peak covers the model state"


def test_cpu_offload_pins_host_state_and_keeps_compute_on_the_gpu() -> None:
    """One process: masters and optimizer state pinned on the host, parameters on the GPU."""
    import rayzero

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    engine, optimizer, _, _ = rayzero.initialize(model=model, config=config)
    loss = engine(torch.randn(4, 64, device="cuda")).pow(2).mean()
    engine.backward(loss)
    engine.step()
    masters = [p for group in optimizer.param_groups for p in group["params"]]
    assert all(m.device.type == "cpu" and m.is_pinned() for m in masters)
    assert all(s["exp_avg"].device.type == "cpu" for s in optimizer.state.values())
    assert all(p.device.type == "cuda" for p in model.parameters())
    stats = engine.memory_stats()
    assert stats["host_bytes"] > 0 and stats["device_bytes"] > 0
    engine.close()


def _offload_engine(zero: dict, clipping: float = 0.0):
    import rayzero

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": clipping,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    return rayzero.initialize(model=model, config=config)[0], model


def test_cpu_step_overlaps_backward_on_cuda_bitwise(monkeypatch) -> None:
    """[Note: step overlapped with backward] with NCCL and pinned host state: the same weights as the
    step after backward, bit for bit, and part of the CPU step hidden behind backward."""
    zero = {"stage": 2, "reduce_bucket_size": 256 * 256, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    finals = []
    for overlap in ("1", "0"):
        monkeypatch.setenv("RAYZERO_OFFLOAD_OVERLAP_STEP", overlap)
        engine, model = _offload_engine(zero)
        generator = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(5):
            engine.backward(engine(torch.randn(8, 256, device="cuda", generator=generator)).pow(2).mean())
            engine.step()
        breakdown = engine.offload_breakdown()
        if overlap == "1":
            assert breakdown["cpu_step_exposed"] < breakdown["cpu_step"], breakdown
        else:
            assert "cpu_step_exposed" not in breakdown
        finals.append(torch.cat([p.detach().flatten().cpu() for p in model.parameters()]))
        engine.close()
    assert torch.equal(finals[0], finals[1])


def test_partial_offload_keeps_the_first_sub_groups_on_the_gpu() -> None:
    zero = {"stage": 3, "sub_group_size": 256 * 256 + 256,
            "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.5}}
    engine, _ = _offload_engine(zero, clipping=1.0)
    engine.backward(engine(torch.randn(8, 256, device="cuda")).pow(2).mean())
    engine.step()
    masters = [p for group in engine.optimizer.param_groups for p in group["params"]]
    devices = [m.device.type for m in masters]
    kept = int((1 - 0.5) * len(masters))  # DeepSpeed's split: the first int((1 - ratio) * n) stay
    assert len(masters) >= 4 and devices == ["cuda"] * kept + ["cpu"] * (len(masters) - kept), devices
    for master in masters:
        state = engine.optimizer.state[master]
        assert state["exp_avg"].device == master.device
        if master.device.type == "cpu":
            assert master.is_pinned()
    engine.close()
