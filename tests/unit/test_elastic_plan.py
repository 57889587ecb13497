"""Which world sizes keep the global batch, and DeepSpeed's `elasticity` batch computation."""
from __future__ import annotations

import pytest

from rayzero.config.errors import RayZeroValueError
from rayzero.config.run_settings import ScalingConfig
from rayzero.controller.elastic import deepspeed_elastic_batch, plan_batches

pytestmark = pytest.mark.unit


def test_gas_is_recomputed_so_the_global_batch_never_changes():
    plan = plan_batches({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2}, 1, 8)
    assert plan.valid_sizes() == [1, 2, 3, 4, 6]
    for size in plan.valid_sizes():
        split = plan.splits[size]
        assert split.micro_batch * split.gradient_accumulation_steps * size == 24
    assert set(plan.skipped) == {5, 7, 8} and "not a multiple" in plan.skipped[5]
    assert plan.choose(5) == 4 and plan.choose(None) == 6 and plan.choose(0) is None
    config = plan.config_for({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "elasticity": {}}, 3)
    assert config == {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}


def test_without_train_batch_size_the_batch_is_fixed_at_the_largest_size():
    plan = plan_batches({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}, 2, 4)
    assert plan.train_batch_size == 16 and plan.valid_sizes() == [2, 4]
    assert plan.splits[2].gradient_accumulation_steps == 2
    assert plan_batches(None, 1, 3).valid_sizes() == [1, 2, 3]  # no batch keys: the loop batches itself


def test_scale_outside_the_range_or_to_a_size_without_a_split_names_the_fix():
    plan = plan_batches({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2}, 2, 8)
    with pytest.raises(RayZeroValueError, match="elastic range is 2:8"):
        plan.check(9)
    with pytest.raises(RayZeroValueError, match=r"valid sizes are \[2, 3, 4, 6\]"):
        plan.check(5)


def test_deepspeed_elasticity_picks_the_batch_with_the_most_valid_sizes():
    # DeepSpeed's documented example block: micro batches 2/4/6 under 2000.
    batch, sizes = deepspeed_elastic_batch([2, 4, 6], 2000, 1, 10_000, prefer_larger=True)
    # candidates: 840x2 = 1680 and 360x4 = 240x6 = 120x12 = 1440; 1680/2 = 840 has 32 divisors, 1440/2 = 720 30
    assert batch == 1680 and len(sizes) == 32
    for size in range(1, 800):
        splits = any(batch % (size * micro) == 0 for micro in (2, 4, 6))
        assert (size in sizes) == splits, size
    _, narrow = deepspeed_elastic_batch([2, 4, 6], 2000, 4, 16, prefer_larger=True)
    assert min(narrow) >= 4 and max(narrow) <= 16


def test_elasticity_block_decides_micro_batch_and_gas_per_size():
    config = {"elasticity": {"enabled": True, "max_train_batch_size": 100, "micro_batch_sizes": [2, 4],
                             "min_gpus": 1, "max_gpus": 8, "version": 0.1}}
    plan = plan_batches(config, 1, 8)
    batch = plan.train_batch_size
    assert batch == deepspeed_elastic_batch([2, 4], 100, 1, 8, True)[0]
    for size, split in plan.splits.items():
        assert split.micro_batch * split.gradient_accumulation_steps * size == batch
        larger = [m for m in (2, 4) if m > split.micro_batch and (batch // size) % m == 0]
        assert not larger  # the largest listed micro batch that divides, as DeepSpeed picks it
    with pytest.raises(RayZeroValueError, match="ignore_non_elastic_batch_info"):
        plan_batches(dict(config, train_batch_size=64), 1, 8)
    assert plan_batches(dict(config, train_batch_size=64, elasticity=dict(
        config["elasticity"], ignore_non_elastic_batch_info=True)), 1, 8).train_batch_size == batch
    with pytest.raises(RayZeroValueError, match="num_gpus_per_node"):
        plan_batches({"elasticity": dict(config["elasticity"], version=0.2, num_gpus_per_node=8)}, 1, 8)


def test_scaling_config_takes_a_range():
    scaling = ScalingConfig(num_workers=(2, 8))
    assert (scaling.min_workers, scaling.max_workers, scaling.elastic) == (2, 8, True)
    assert not ScalingConfig(num_workers=4).elastic
    with pytest.raises(ValueError, match="1 <= min <= max"):
        ScalingConfig(num_workers=(4, 2))


def test_cli_workers_takes_a_count_or_a_range():
    import argparse

    from rayzero.driver.cli import _workers

    assert _workers("4") == 4 and _workers("2:8") == (2, 8)
    with pytest.raises(argparse.ArgumentTypeError, match="MIN:MAX"):
        _workers("2-8")


def test_should_stop_is_false_outside_a_rayzero_worker():
    import rayzero

    assert rayzero.get_context().should_stop() is False
