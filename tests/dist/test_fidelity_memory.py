"""Stage 3 saves peak process memory, not only model-state bytes (issue 12 item 4), tried as a new
user would: ≈50M parameters, 2 ranks, AdamW, "auto" bucket sizes (from the hidden size), the model
built partitioned with rayzero.zero.Init. Peak RSS above each rank's start, each stage in fresh
processes (the peak only grows), glibc told to return freed large blocks (a fixed mmap threshold)
so the peak is what was live.

Measured (MiB above start, per rank): stage 0 ≈ 1065; stage 3 with stage3_max_reuse_distance 0
≈ 588 (0.55×) in a standalone script, ≈ 697 (0.65×) under pytest (the heap layout differs); with
DeepSpeed's default reuse distance 1e9 ≈ 740 (0.69×): a reuse distance larger than the model keeps
every parameter gathered from its forward use to its backward use, as DeepSpeed's does. The bounds
below are regression guards with headroom (the issue measured stage 3 above stage 0); the issue's
0.6× is met standalone, not yet here.
"""
from __future__ import annotations

import os
import resource

import pytest
import torch

from tests.dist.harness import spawn

pytestmark = pytest.mark.dist

HIDDEN, LAYERS = 1024, 6  # 6 x (1024x4096 + 4096x1024) ≈ 50.4M parameters


class Tower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.GELU(), torch.nn.Linear(4 * HIDDEN, HIDDEN))
            for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x.square().mean()


def _peak_mib(rank: int, world: int, payload: dict) -> float:
    import rayzero

    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": payload["stage"], "reduce_bucket_size": "auto",
                                    "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto", **payload["zero"]}}
    torch.manual_seed(0)
    if payload["stage"] == 3:
        with rayzero.zero.Init(config=config):
            model = Tower()
    else:
        model = Tower()
    engine, *_ = rayzero.initialize(model=model, config=config)
    for step in range(2):
        x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(step * 10 + rank))
        engine.backward(engine(x))
        engine.step()
    engine.close()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) / 1024


def _peak(stage: int, **zero: object) -> float:
    previous = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # inherited by the spawned ranks
    try:
        return max(spawn(2, _peak_mib, {"stage": stage, "zero": zero}))
    finally:
        if previous is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_")
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = previous


def test_stage3_peak_memory_is_well_below_stage0():
    stage0 = _peak(0)
    released = _peak(3, stage3_max_reuse_distance=0)
    kept = _peak(3)  # DeepSpeed's default reuse distance (1e9) > the model
    print(f"peak MiB above start: stage 0 {stage0:.0f}, stage 3 {released:.0f} (reuse 0), {kept:.0f} (reuse 1e9)")
    assert released <= 0.7 * stage0, f"stage 3 {released:.0f} MiB vs stage 0 {stage0:.0f} MiB"
    assert kept < 0.8 * stage0, f"stage 3 with default reuse {kept:.0f} MiB vs stage 0 {stage0:.0f} MiB"
