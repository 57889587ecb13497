"""`checkpoint.interval: "auto"` ([Note: a checkpoint interval from the numbers]): Young/Daly's
sqrt(2 x C x M) from the measured save stall and a failure rate that learns from the run."""
from __future__ import annotations

import math

import pytest

from rayzero.controller.interval import PRIOR_STALL_S, CheckpointInterval

pytestmark = pytest.mark.unit

LLAMA3 = 419 / (54 * 2048)  # unexpected interruptions per node and day


def test_the_interval_is_young_daly_from_the_measured_stall_and_the_prior_mtbf():
    policy = CheckpointInterval("auto", LLAMA3)
    prior_mtbf = 86_400 / (2048 * LLAMA3)  # 2,048 nodes: one failure every ~3.1 h, as Llama 3 saw
    assert prior_mtbf / 3600 == pytest.approx(54 * 24 / 419, rel=1e-9)
    assert policy.seconds(2048, 0, 0.0) == pytest.approx(math.sqrt(2 * PRIOR_STALL_S * prior_mtbf))
    policy.saved(20.0)  # a measured save: C follows what the run pays, not the prior
    assert policy.seconds(2048, 0, 0.0) == pytest.approx(math.sqrt(2 * 20.0 * prior_mtbf))
    policy.saved(10.0)
    assert policy.seconds(2048, 0, 0.0) == pytest.approx(math.sqrt(2 * (0.3 * 10 + 0.7 * 20) * prior_mtbf))
    assert policy.seconds(1, 0, 0.0) > policy.seconds(2048, 0, 0.0)  # one node fails far less often


def test_it_adapts_after_failures_and_to_a_run_that_does_not_fail():
    policy = CheckpointInterval("auto", LLAMA3)
    policy.saved(10.0)
    prior = 86_400 / (16 * LLAMA3)
    calm = policy.seconds(16, 0, 0.0)
    hour = 3600.0
    # 4 failures in an hour: M is (prior + 1 h) / 5, the interval shrinks by sqrt of that
    assert policy.seconds(16, 4, hour) == pytest.approx(math.sqrt(2 * 10.0 * (prior + hour) / 5))
    assert policy.seconds(16, 4, hour) < calm / 2
    # many failure-free days: the estimate follows the run's own record upward
    assert policy.seconds(16, 0, 30 * 86_400) > calm


def test_a_fixed_interval_and_none():
    assert CheckpointInterval(120.0, LLAMA3).seconds(8, 3, 10.0) == 120.0
    assert CheckpointInterval(None, LLAMA3).seconds(8, 0, 0.0) is None
    assert CheckpointInterval(None, LLAMA3).describe(8, 0, 0.0) == {}
    shown = CheckpointInterval("auto", LLAMA3).describe(8, 1, 3600.0)
    assert set(shown) == {"checkpoint_interval_s", "checkpoint_interval_inputs"}
    assert "C 5 s prior" in shown["checkpoint_interval_inputs"] and "1 failure(s)" in shown["checkpoint_interval_inputs"]
