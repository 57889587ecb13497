"""An engine dropped without close() frees its model, buffers and optimizer state.

[Note: gradient hooks hold their engine weakly]: a gradient hook that held the strategy strongly
kept everything alive for the life of the process (torch's C++ side holds the hook, out of the cycle
collector's sight). Found on an H200: each engine bench/gpu.py built started with the last one's
GPU memory still allocated. One spawned gloo rank builds, trains and drops an engine per stage and
offload mode, and reports which objects survived `gc.collect()`: the engine, its strategy, the
module, the optimizer and a parameter (a parameter survived its module on an H100: its bucket held it,
and its hook held the bucket).
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from testkit import harness as H

pytestmark = pytest.mark.dist

CONFIGS = {f"stage{stage}": {"stage": stage} for stage in (0, 1, 2, 3)}
CONFIGS["stage1-offload-cpu"] = {"stage": 1, "offload_optimizer": {"device": "cpu"}}
CONFIGS["stage2-offload-cpu"] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
CONFIGS["stage3-offload-cpu"] = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}


def _train_and_drop(zero: dict) -> dict[str, weakref.ref]:
    import rayzero

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, optimizer, _, _ = rayzero.initialize(model=model, config=config)
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 32)).pow(2).mean())
        engine.step()
    return {"engine": weakref.ref(engine), "strategy": weakref.ref(engine.strategy),
            "model": weakref.ref(model), "optimizer": weakref.ref(optimizer),
            # a parameter outlived its module while its bucket (or stage-3 entry) held it and its
            # hook held the bucket: the flat parameter and gradient buffers with it
            "parameter": weakref.ref(next(model.parameters()))}


def survivors(rank: int, world: int, payload: None) -> dict[str, list[str]]:
    import os
    import threading

    os.environ["RAYZERO_OFFLOAD_OVERLAP_STEP"] = "1"  # the offload cases' CPU-step thread runs on CPU too
    out = {}
    for name, zero in CONFIGS.items():
        refs = _train_and_drop(zero)
        gc.collect()
        out[name] = sorted(what for what, ref in refs.items() if ref() is not None)
        out[name] += [thread.name for thread in threading.enumerate() if thread.name.startswith("rayzero-")]
    return out


def test_an_engine_dropped_without_close_frees_its_model_and_state() -> None:
    """...and stops its threads (the CPU step's thread once held its stepper through its initializer)."""
    (result,) = H.spawn(1, survivors)
    assert result == {name: [] for name in CONFIGS}, result
