"""The five schedules give DeepSpeed's lr (and momentum) at each step.

Expected values are computed here from the formulas in DeepSpeed's lr_schedules.py, written out
independently, and compared with what the optimizer actually sees before each of its steps.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rayzero.engine.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler


def make_optimizer(kind: str = "adam", lr: float = 0.5) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(2))]
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.95))
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def seen_lrs(scheduler, optimizer, steps: int) -> list[float]:
    """lr the optimizer uses at each of `steps` training steps (DeepSpeed steps after optimizer.step)."""
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def ds_warmup(i: int, low: float, high: float, n: int, kind: str, total: int | None = None) -> float:
    n = max(2, n)
    if i < 0:
        return low
    if i < n:
        gamma = math.log(i + 1) / math.log(n) if kind == "log" else i / n
    elif total is None:
        gamma = 1.0
    else:
        gamma = max(0.0, (total - i) / max(1.0, total - n))
    return low + (high - low) * gamma


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_matches_deepspeed_formula(kind):
    optimizer = make_optimizer()
    scheduler = WarmupLR(optimizer, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=5, warmup_type=kind)
    lrs = seen_lrs(scheduler, optimizer, 9)
    # the lr used at training step s is the one computed for batch iteration s - 1
    expected = [ds_warmup(s - 1, 0.01, 0.1, 5, kind) for s in range(9)]
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert lrs[-1] == pytest.approx(0.1) and lrs[0] == pytest.approx(0.01)
    assert scheduler.get_last_lr() == [optimizer.param_groups[0]["lr"]]


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_matches_deepspeed_formula(kind):
    optimizer = make_optimizer(lr=0.5)
    scheduler = WarmupCosineLR(optimizer, total_num_steps=20, warmup_min_ratio=0.2, warmup_num_steps=5,
                               cos_min_ratio=0.01, warmup_type=kind)
    assert optimizer.param_groups[0]["lr"] == 0.0  # iteration -1, as DeepSpeed
    scheduler.step()
    expected = []
    for i in range(30):
        if i < 5:
            gamma = math.log(i + 1) / math.log(5) if kind == "log" else i / 5
            ratio = 0.2 + 0.8 * gamma
        else:
            progress = min(1.0, (i - 5 + 1) / 15)
            ratio = 0.01 + 0.99 * (1 + math.cos(math.pi * progress)) / 2
        expected.append(0.5 * ratio)
    assert seen_lrs(scheduler, optimizer, 30) == pytest.approx(expected, rel=1e-12)
    assert expected[-1] == pytest.approx(0.5 * 0.01)  # holds the floor after total_num_steps


def test_warmup_cosine_lr_refuses_zero_warmup_steps():
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupCosineLR(make_optimizer(), total_num_steps=10, warmup_num_steps=0)


def test_warmup_lr_defaults_max_to_the_optimizer_lr():
    optimizer = make_optimizer(lr=0.25)
    scheduler = WarmupLR(optimizer, warmup_num_steps=3, warmup_type="linear")
    assert seen_lrs(scheduler, optimizer, 6)[-1] == pytest.approx(0.25)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_matches_deepspeed_formula_and_reaches_zero(kind):
    optimizer = make_optimizer()
    scheduler = WarmupDecayLR(optimizer, total_num_steps=12, warmup_min_lr=0.0, warmup_max_lr=0.2,
                              warmup_num_steps=4, warmup_type=kind)
    lrs = seen_lrs(scheduler, optimizer, 16)
    expected = [ds_warmup(s - 1, 0.0, 0.2, 4, kind, total=12) for s in range(16)]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert lrs[-1] == 0.0 and max(lrs) == pytest.approx(0.2)


def ds_one_cycle(i, lo, hi, first, second, stairs1, stairs2, decay_step, decay_rate, mlo, mhi, mom_rate):
    """(lr, momentum) DeepSpeed's OneCycle computes for batch iteration i."""
    total = first + second
    if i < 0:
        return lo, mlo
    if i < total:
        b = i + 1
        cycle = math.floor(1 + b / total)
        x = 1.0 + b / total - cycle
        ratio = first / total
        if x <= ratio:
            scale, stairs = x / ratio, stairs1
        else:
            scale, stairs = (x - 1) / (ratio - 1), stairs2
        if stairs > 0:
            c = b % total
            pos = c * stairs / first if c <= first else (total - c) * stairs / second
            scale = math.floor(pos) / stairs
        return lo + (hi - lo) * scale, mhi - (mhi - mlo) * scale
    k = i - total + 1
    lr = lo if decay_step == 0 or decay_rate == 0 else lo / (1 + decay_rate * k / decay_step)
    mom = mhi if decay_step == 0 or mom_rate == 0 else mhi * (1 + mom_rate * k / decay_step)
    return lr, mom


@pytest.mark.parametrize("stairs", [(0, 0), (2, 3)])
def test_one_cycle_lr_and_momentum_match_deepspeed(stairs):
    optimizer = make_optimizer("adam")
    args = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "decay_lr_rate": 0.5, "cycle_first_step_size": 4,
                "cycle_second_step_size": 6, "cycle_first_stair_count": stairs[0],
                "cycle_second_stair_count": stairs[1], "decay_step_size": 2, "cycle_momentum": True,
                "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.01}
    scheduler = OneCycle(optimizer, **args)
    lrs, moms = [], []
    for _ in range(16):
        lrs.append(optimizer.param_groups[0]["lr"])
        moms.append(optimizer.param_groups[0]["betas"][0])
        assert optimizer.param_groups[0]["betas"][1] == 0.95  # the user's beta2 is kept
        optimizer.step()
        scheduler.step()
    expected = [ds_one_cycle(s - 1, 0.01, 0.1, 4, 6, stairs[0], stairs[1], 2, 0.5, 0.85, 0.95, 0.01)
                for s in range(16)]
    assert lrs == pytest.approx([e[0] for e in expected], rel=1e-12)
    assert moms == pytest.approx([e[1] for e in expected], rel=1e-12)
    assert max(lrs) == pytest.approx(0.1)  # the peak is reached at the end of the first half
    assert lrs[-1] < 0.01  # decayed below the cycle floor afterwards


def test_one_cycle_cycles_sgd_momentum():
    optimizer = make_optimizer("sgd")
    scheduler = OneCycle(optimizer, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=2,
                         cycle_min_mom=0.5, cycle_max_mom=0.9)
    moms = []
    for _ in range(5):
        optimizer.step()
        scheduler.step()
        moms.append(optimizer.param_groups[0]["momentum"])
    assert moms == pytest.approx([ds_one_cycle(i, 0.1, 1.0, 2, 2, 0, 0, 0, 0, 0.5, 0.9, 0)[1] for i in range(5)])


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_matches_deepspeed(staircase):
    optimizer = make_optimizer()
    scheduler = LRRangeTest(optimizer, lr_range_test_min_lr=0.002, lr_range_test_step_size=3,
                            lr_range_test_step_rate=2.0, lr_range_test_staircase=staircase)
    lrs = seen_lrs(scheduler, optimizer, 10)

    def ds(i):
        interval = (i + 1) / 3
        return 0.002 * (1 + 2.0 * (math.floor(interval) if staircase else interval))

    assert lrs == pytest.approx([0.002] + [ds(s - 1) for s in range(1, 10)], rel=1e-12)


def test_state_dict_resumes_the_same_schedule():
    optimizer = make_optimizer()
    scheduler = WarmupDecayLR(optimizer, total_num_steps=20, warmup_max_lr=0.3, warmup_num_steps=5)
    full = seen_lrs(scheduler, optimizer, 12)
    first_optimizer = make_optimizer()
    first = WarmupDecayLR(first_optimizer, total_num_steps=20, warmup_max_lr=0.3, warmup_num_steps=5)
    seen_lrs(first, first_optimizer, 7)
    saved = first.state_dict()
    resumed_optimizer = make_optimizer()
    resumed = WarmupDecayLR(resumed_optimizer, total_num_steps=20, warmup_max_lr=0.3, warmup_num_steps=5)
    resumed.load_state_dict(saved)
    resumed.step(resumed.last_batch_iteration)  # re-apply the saved iteration's lr, as a resume does
    assert seen_lrs(resumed, resumed_optimizer, 5) == pytest.approx(full[7:])


def test_build_scheduler_from_config_sections():
    optimizer = make_optimizer()
    scheduler = build_scheduler(SimpleNamespace(type="WarmupLR", params={"warmup_max_lr": 0.05,
                                                                        "warmup_num_steps": 2}), optimizer)
    assert isinstance(scheduler, WarmupLR) and scheduler.max_lrs == [0.05]
    assert isinstance(build_scheduler({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1}},
                                      optimizer), OneCycle)
    assert build_scheduler(None, optimizer) is None
    with pytest.raises(ValueError, match="scheduler.type='Cosine'"):
        build_scheduler({"type": "Cosine", "params": {}}, optimizer)
    with pytest.raises(ValueError, match="warmup_typo"):
        build_scheduler({"type": "WarmupLR", "params": {"warmup_typo": 1}}, optimizer)
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(optimizer, warmup_type="cosine")


@pytest.mark.parametrize("kind, params", [
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 7}),
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 7, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 30, "warmup_max_lr": 0.2, "warmup_num_steps": 5}),
    ("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 6, "warmup_min_ratio": 0.1,
                        "cos_min_ratio": 0.05}),
    ("WarmupCosineLR", {"total_num_steps": 25, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 3, "warmup_num_steps": 8}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.002, "lr_range_test_step_size": 3,
                     "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "decay_lr_rate": 0.5, "cycle_first_step_size": 4,
                  "cycle_second_step_size": 6, "cycle_first_stair_count": 2, "cycle_second_stair_count": 3,
                  "decay_step_size": 2, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.01}),
])
def test_matches_deepspeed_schedules(kind, params):
    """Where DeepSpeed is installed (`make bench`), its own schedules are the oracle."""
    deepspeed_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    theirs_optimizer, ours_optimizer = make_optimizer(), make_optimizer()
    theirs = getattr(deepspeed_schedules, kind)(theirs_optimizer, **params)
    ours = build_scheduler({"type": kind, "params": params}, ours_optimizer)
    for _ in range(40):
        theirs_group, ours_group = theirs_optimizer.param_groups[0], ours_optimizer.param_groups[0]
        assert ours_group["lr"] == pytest.approx(theirs_group["lr"], rel=1e-12)
        assert ours_group["betas"][0] == pytest.approx(theirs_group["betas"][0], rel=1e-12)
        for optimizer, scheduler in ((theirs_optimizer, theirs), (ours_optimizer, ours)):
            optimizer.step()
            scheduler.step()
