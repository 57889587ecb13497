"""`checkpoint.interval: "auto"` ([Note: a checkpoint interval from the numbers]): Young/Daly's
sqrt(2 x C x M) from the measured save stall and a failure rate that learns from the run, its
earlier calls included."""
from __future__ import annotations

import json
import math

import pytest

from rayzero.controller.interval import PRIOR_STALL_S, CheckpointInterval

pytestmark = pytest.mark.unit

LLAMA3 = 419 / (54 * 2048)  # unexpected interruptions per node and day
DAY = 86_400.0
HOUR = 3600.0


def test_the_interval_is_young_daly_from_the_measured_stall_and_the_fleet_mtbf_on_a_long_run():
    policy = CheckpointInterval("auto", LLAMA3)
    prior_mtbf = DAY / (2048 * LLAMA3)  # 2,048 nodes: one failure every ~3.1 h, as Llama 3 saw
    assert prior_mtbf / HOUR == pytest.approx(54 * 24 / 419, rel=1e-9)
    wall = 10 * prior_mtbf  # failure-free for ten prior MTBFs: the fleet's Gamma posterior governs
    mtbf = (prior_mtbf + wall) / 1  # (M0 + W) / (1 + n), n = 0
    assert policy.seconds(2048, 0, wall) == pytest.approx(math.sqrt(2 * PRIOR_STALL_S * mtbf))
    policy.saved(20.0)  # a measured save: C follows what the run pays, not the prior
    assert policy.seconds(2048, 0, wall) == pytest.approx(math.sqrt(2 * 20.0 * mtbf))
    policy.saved(10.0)
    assert policy.seconds(2048, 0, wall) == pytest.approx(math.sqrt(2 * (0.3 * 10 + 0.7 * 20) * mtbf))
    # one failure in that time: (M0 + W) / 2, still the fleet's (the run's own (1 + 1/2) / W is lower)
    assert policy.mean_time_between_failures_s(2048, 1, wall) == pytest.approx((prior_mtbf + wall) / 2)


def test_before_any_failure_the_interval_is_bounded_by_the_runs_age():
    """No failure in W seconds rates the run at one per 2W (Jeffreys), so T = 2 sqrt(C W) until W
    passes the fleet's MTBF; the first checkpoint comes once the run has been up about 4C."""
    policy = CheckpointInterval("auto", LLAMA3)
    three_nodes = DAY / (3 * LLAMA3)
    assert three_nodes / DAY == pytest.approx(88.0, abs=0.1)  # the fleet prior alone: ~1 failure in 88 days
    assert policy.seconds(3, 0, 96.0) == pytest.approx(math.sqrt(2 * PRIOR_STALL_S * 2 * 96.0))  # ~44 s, not ~3 h
    assert policy.seconds(3, 0, 4 * PRIOR_STALL_S) == pytest.approx(4 * PRIOR_STALL_S)  # T = W at W = 4C
    policy.saved(0.03)
    assert policy.seconds(3, 0, 60.0) == pytest.approx(math.sqrt(2 * 0.03 * 120.0))
    # the bound lifts with the square root of the run's age, and ends where the fleet's estimate is the
    # larger rate: W > M0 (with n = 0, (1 + 0) / (M0 + W) > 1 / (2 W) exactly when W > M0)
    assert policy.seconds(3, 0, 4 * HOUR) == pytest.approx(2 * policy.seconds(3, 0, HOUR))
    assert policy.mean_time_between_failures_s(3, 0, 2 * three_nodes) == pytest.approx(3 * three_nodes)
    assert policy.mean_time_between_failures_s(3, 0, three_nodes / 2) == pytest.approx(three_nodes)


def test_it_adapts_after_failures_and_the_prior_cannot_swamp_the_runs_record():
    policy = CheckpointInterval("auto", LLAMA3)
    policy.saved(0.5)
    calm = policy.seconds(16, 0, HOUR)
    # 4 failures in an hour on 16 nodes (the prior: one failure in ~16 days): M = 1 h / 4.5
    assert policy.mean_time_between_failures_s(16, 4, HOUR) == pytest.approx(HOUR / 4.5)
    assert policy.seconds(16, 4, HOUR) == pytest.approx(math.sqrt(2 * 0.5 * HOUR / 4.5))
    assert policy.seconds(16, 4, HOUR) < calm / 2
    # one failure a minute for ten minutes: the estimate is the run's, a minute (not days)
    assert policy.mean_time_between_failures_s(3, 10, 600.0) == pytest.approx(600 / 10.5)
    # every failure shortens it, and a long failure-free stretch afterwards lengthens it again
    intervals = [policy.seconds(3, failures, 600.0) for failures in range(5)]
    assert intervals == sorted(intervals, reverse=True) and len(set(intervals)) == 5
    assert policy.seconds(3, 4, 30 * DAY) > policy.seconds(3, 4, DAY)


def test_failures_count_across_a_driver_rerun_and_a_killed_call_is_one():
    """The record a call leaves beside its goodput figures ([Note: goodput accounting]) brings its
    failures and measured stall to the next call; a call that never said it ended (its driver was
    killed) counts as one more failure, a call that ended (finished, stopped) does not."""
    first = CheckpointInterval("auto", LLAMA3)
    first.saved(0.2)
    running = json.loads(json.dumps({"wall_s": 100.0, **first.record(failures=2, ended=False)}))  # goodput.json
    rerun = CheckpointInterval("auto", LLAMA3, carried=running)
    assert rerun.earlier_failures == 3  # 2 seen, and the killed driver
    assert rerun.stall_s == pytest.approx(0.2)  # C measured before, not the 5 s prior
    assert rerun.mean_time_between_failures_s(3, 0, 100.0) == pytest.approx(100.0 / 3.5)
    assert rerun.seconds(3, 1, 120.0) == pytest.approx(math.sqrt(2 * 0.2 * 120.0 / 4.5))  # and this call's
    assert rerun.record(failures=1, ended=True)["checkpoint_interval"]["failures"] == 4
    ended = CheckpointInterval("auto", LLAMA3, carried=first.record(failures=2, ended=True))
    assert ended.earlier_failures == 2  # a stop + rerun is no failure
    assert CheckpointInterval("auto", LLAMA3, carried={"wall_s": 5.0}).earlier_failures == 0  # older goodput.json


def test_a_fixed_interval_and_none():
    assert CheckpointInterval(120.0, LLAMA3).seconds(8, 3, 10.0) == 120.0
    assert CheckpointInterval(None, LLAMA3).seconds(8, 0, 0.0) is None
    assert CheckpointInterval(None, LLAMA3).describe(8, 0, 0.0) == {}
    shown = CheckpointInterval("auto", LLAMA3).describe(8, 1, 3600.0)
    assert set(shown) == {"checkpoint_interval_s", "checkpoint_interval_inputs"}
    inputs = shown["checkpoint_interval_inputs"]
    assert "C 5 s prior" in inputs and "1 failure(s) in 1.0 h" in inputs and "the run's own record" in inputs
    assert "M 40.0 min" in inputs  # 1 h / 1.5
