"""DynamicLossScaler follows DeepSpeed's update rule step by step (trajectories worked out by hand
from deepspeed/runtime/fp16/loss_scaler.py: DynamicLossScaler.update_scale)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from rayzero.engine.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimumError,
    StaticLossScaler,
    build_loss_scaler,
    local_overflow,
)


def run(scaler: DynamicLossScaler, overflows: str) -> list[float]:
    """Feed a pattern like 'ooxo' (x = overflow) and return the scale after each step."""
    scales = []
    for ch in overflows:
        scaler.update_scale(ch == "x")
        scales.append(scaler.loss_scale)
    return scales


def test_scale_grows_after_window_good_steps_counted_as_deepspeed_does():
    scaler = DynamicLossScaler(init_scale=2.0**4, scale_window=3, min_scale=1, hysteresis=1)
    # DeepSpeed: stable_interval = cur_iter - last_overflow_iter - 1 starts at 0, so the first
    # doubling happens on the 4th good step (cur_iter 3), then every 3 steps.
    assert run(scaler, "ooooooo") == [16, 16, 16, 32, 32, 32, 64]


def test_overflow_halves_immediately_with_hysteresis_one_and_restarts_the_window():
    scaler = DynamicLossScaler(init_scale=64, scale_window=2, min_scale=1, hysteresis=1)
    # overflow at iter 1 -> 32; window restarts: stable_interval at iter 2 is 0, iter 3 is 1,
    # iter 4 is 2 -> doubles there.
    assert run(scaler, "oxooo") == [64, 32, 32, 32, 64]
    assert scaler.overflow_count == 1


def test_hysteresis_delays_the_first_decrease_and_refills_only_on_growth():
    scaler = DynamicLossScaler(init_scale=64, scale_window=100, min_scale=1, hysteresis=2)
    # 1st overflow spends hysteresis (2 -> 1), scale kept; every later overflow halves because
    # non-consecutive hysteresis is refilled only when the scale grows.
    assert run(scaler, "xoxox") == [64, 64, 32, 32, 16]
    assert scaler.cur_hysteresis == 1


def test_consecutive_hysteresis_refills_after_any_good_step():
    scaler = DynamicLossScaler(init_scale=64, scale_window=100, min_scale=1, hysteresis=2,
                               consecutive_hysteresis=True)
    # isolated overflows never lower the scale; two in a row do.
    assert run(scaler, "xoxoxx") == [64, 64, 64, 64, 64, 32]


def test_non_consecutive_hysteresis_is_refilled_when_the_scale_grows():
    scaler = DynamicLossScaler(init_scale=8, scale_window=2, min_scale=1, hysteresis=2)
    # x at iter0: hysteresis 2->1. iters 1,2 good: stable 0,1; iter 3: stable 2 -> grow to 16 and
    # refill hysteresis to 2, so the next overflow is again tolerated.
    assert run(scaler, "xoooxo") == [8, 8, 8, 16, 16, 16]
    assert scaler.cur_hysteresis == 1


def test_min_scale_floor_and_error_when_overflowing_at_the_floor():
    scaler = DynamicLossScaler(init_scale=4, scale_window=1000, min_scale=1.5, hysteresis=1)
    assert run(scaler, "xx") == [2, 1.5]
    with pytest.raises(LossScaleAtMinimumError, match="min_loss_scale"):
        scaler.update_scale(True)
    tolerant = DynamicLossScaler(init_scale=2, scale_window=1000, min_scale=2, hysteresis=1,
                                 raise_error_at_min_scale=False)
    assert run(tolerant, "xx") == [2, 2]


def test_state_dict_is_json_and_resumes_the_same_trajectory():
    pattern = "ooxoooxxoooooooxoooo"
    reference = DynamicLossScaler(init_scale=2.0**10, scale_window=3, min_scale=1, hysteresis=2)
    expected = run(reference, pattern)
    first = DynamicLossScaler(init_scale=2.0**10, scale_window=3, min_scale=1, hysteresis=2)
    run(first, pattern[:9])
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = DynamicLossScaler(init_scale=2.0**10, scale_window=3, min_scale=1, hysteresis=2)
    resumed.load_state_dict(saved)
    assert run(resumed, pattern[9:]) == expected[9:]
    with pytest.raises(ValueError, match="loss_scale"):
        StaticLossScaler(8).load_state_dict(saved)


def test_static_scaler_never_changes_but_counts_skipped_steps():
    scaler = StaticLossScaler(128.0)
    for overflow in (True, False, True):
        scaler.update_scale(overflow)
    assert scaler.loss_scale == 128.0 and scaler.overflow_count == 2
    loss = torch.tensor(0.5)
    assert scaler.scale_loss(loss).item() == 64.0
    restored = StaticLossScaler(128.0)
    restored.load_state_dict(json.loads(json.dumps(scaler.state_dict())))
    assert restored.overflow_count == 2


def test_build_from_fp16_config_section():
    dynamic = build_loss_scaler(SimpleNamespace(enabled=True, loss_scale=0, initial_scale_power=12,
                                                loss_scale_window=50, hysteresis=3, min_loss_scale=0.5,
                                                consecutive_hysteresis=True))
    assert isinstance(dynamic, DynamicLossScaler)
    assert (dynamic.loss_scale, dynamic.scale_window, dynamic.hysteresis, dynamic.min_scale) == (4096, 50, 3, 0.5)
    assert dynamic.consecutive_hysteresis
    static = build_loss_scaler(SimpleNamespace(enabled=True, loss_scale=256.0))
    assert isinstance(static, StaticLossScaler) and static.loss_scale == 256.0
    # bf16 / fp32 runs: nothing to scale.
    assert build_loss_scaler(None).loss_scale == 1.0
    assert build_loss_scaler(SimpleNamespace(enabled=False, loss_scale=0)).loss_scale == 1.0
    with pytest.raises(ValueError, match="fp16.loss_scale"):
        build_loss_scaler(SimpleNamespace(enabled=True, loss_scale=-1.0))
    with pytest.raises(ValueError, match="fp16.hysteresis"):
        DynamicLossScaler(hysteresis=0)


def test_local_overflow_flags_inf_and_nan_only():
    finite = [torch.ones(3, dtype=torch.float16), torch.zeros(2)]
    assert local_overflow(finite).item() == 0.0
    assert local_overflow(finite + [torch.tensor([1.0, float("inf")])]).item() == 1.0
    assert local_overflow([torch.tensor([float("nan")], dtype=torch.bfloat16)]).item() == 1.0
    assert local_overflow([]).item() == 0.0


def test_matches_deepspeed_on_random_overflow_patterns(monkeypatch):
    """Where DeepSpeed is installed (`make bench`), its own DynamicLossScaler is the oracle."""
    import random

    deepspeed_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    # DeepSpeed asks its comm layer for the rank only to decide whether to log.
    monkeypatch.setattr(deepspeed_scaler.dist, "get_rank", lambda: 0)
    rng = random.Random(0)
    for _ in range(200):
        window, hysteresis = rng.randint(1, 6), rng.randint(1, 4)
        consecutive, floor = rng.random() < 0.5, rng.choice([0.25, 1.0, 4.0])
        init = 2.0 ** rng.randint(3, 12)
        theirs = deepspeed_scaler.DynamicLossScaler(init_scale=init, scale_window=window, min_scale=floor,
                                                    delayed_shift=hysteresis, consecutive_hysteresis=consecutive,
                                                    raise_error_at_min_scale=False)
        ours = DynamicLossScaler(init_scale=init, scale_window=window, min_scale=floor, hysteresis=hysteresis,
                                 consecutive_hysteresis=consecutive, raise_error_at_min_scale=False)
        for _ in range(60):
            overflow = rng.random() < 0.3
            theirs.update_scale(overflow)
            ours.update_scale(overflow)
            assert (ours.cur_scale, ours.cur_hysteresis) == (theirs.cur_scale, theirs.cur_hysteresis)


def test_the_config_defaults_are_deepspeeds():
    """Only rayzero.config holds defaults; DeepSpeed 0.19.8's fp16 defaults, written out here."""
    from rayzero.config import load_config

    config = load_config({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}})
    dynamic = build_loss_scaler(config.fp16)
    assert (dynamic.loss_scale, dynamic.scale_window, dynamic.hysteresis, dynamic.min_scale) == (2.0 ** 16, 1000, 2, 1.0)
    assert not dynamic.consecutive_hysteresis
