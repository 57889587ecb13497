"""The goodput accountant on a made-up timeline ([Note: goodput accounting]): every second lands in
one bucket, redone steps and save stalls come out of productive time, and a rerun carries on."""
from __future__ import annotations

import pytest

from rayzero.controller.goodput import Goodput

pytestmark = pytest.mark.unit


def _run() -> Goodput:
    g = Goodput(0.0)
    g.attempt_began(0, "start", 0.0, None)
    g.placement_waited(1.0, 3.0)            # 0-1 s placement (idle), 1-3 s start-up
    for step in range(1, 11):               # first report at 4 s, then a step a second to 13 s
        g.reported(step, 3.0 + step)
        if step == 5:
            g.checkpointed(5)
    g.save_stalled(2.0, 10.5)               # the save after step 5 took 2 s (seen by a heartbeat)
    g.failed(15.0)                          # last report at 13 s: 2 s of detection
    g.attempt_began(1, "worker died", 18.0, 5)   # 15-18 s restart; resumes from step 5
    for step in range(6, 11):
        g.reported(step, 20.0 + step - 5)   # first report at 21 s: 18-21 s restart
    g.ended(26.0, 10, failed=False)         # the loops were done at 25 s: 1 s of shutdown
    return g


def test_every_second_lands_in_one_bucket_and_redone_steps_and_stalls_are_not_productive():
    snapshot = _run().snapshot(100.0)       # after the end, wall time stops growing
    badput = snapshot["badput_s"]
    assert snapshot["wall_s"] == pytest.approx(26.0) and badput["shutdown"] == pytest.approx(1.0)
    assert badput["idle"] == pytest.approx(1.0) and badput["start-up"] == pytest.approx(3.0)
    assert badput["failure detection"] == pytest.approx(2.0)
    assert badput["restart"] == pytest.approx(3.0 + 3.0)
    assert badput["checkpoint stall"] == pytest.approx(2.0)
    # steps 6-10 of the first attempt ran again: from step 5's report (8 s) to the last (13 s), less the
    # 2 s stall in between
    assert badput["redone steps"] == pytest.approx(5.0 - 2.0)
    # kept: 4-13 s of the first attempt less the stall and the redone part, 21-25 s of the second
    assert snapshot["productive_s"] == pytest.approx(9.0 - 2.0 - 3.0 + 4.0)
    assert sum(badput.values()) + snapshot["productive_s"] == pytest.approx(snapshot["wall_s"])
    assert snapshot["goodput"] == pytest.approx(snapshot["productive_s"] / 26.0, rel=1e-3)
    assert set(snapshot["attempts"]) == {"0", "1"} and snapshot["attempts"]["1"]["restart"] == pytest.approx(3.0)


def test_a_rerun_carries_the_earlier_calls_totals_and_a_planned_resize_is_planned():
    before = _run().snapshot(26.0)
    g = Goodput(1000.0, carried=before)
    g.attempt_began(0, "rerun", 1000.0, 10)
    g.reported(11, 1004.0)
    g.planned(1006.0)
    g.attempt_began(1, "resize scale", 1008.0, 11)
    g.reported(12, 1010.0)
    g.ended(1012.0, 12, failed=False)       # 2 s after its last step: shutdown
    snapshot = g.snapshot(1012.0)
    assert snapshot["wall_s"] == pytest.approx(26.0 + 12.0)
    assert snapshot["badput_s"]["start-up"] == pytest.approx(3.0 + 4.0)
    assert snapshot["badput_s"]["planned"] == pytest.approx(2.0 + 2.0)  # the stop's save, then the regroup
    assert snapshot["productive_s"] == pytest.approx(before["productive_s"] + 2.0)
    assert snapshot["badput_s"]["shutdown"] == pytest.approx(1.0 + 2.0)


def test_a_run_that_ends_on_a_failure_loses_what_its_newest_checkpoint_does_not_keep():
    g = Goodput(0.0)
    g.attempt_began(0, "start", 0.0, None)
    for step in range(1, 6):
        g.reported(step, float(step))
    g.failed(6.0)
    g.ended(6.0, None, failed=True)  # no checkpoint: nothing of it is kept
    snapshot = g.snapshot(6.0)
    assert snapshot["productive_s"] == pytest.approx(0.0) and snapshot["badput_s"]["redone steps"] == pytest.approx(4.0)


def _killed_driver_call() -> dict:
    """A call whose driver was killed at 13.5 s: rank 0 reported steps 1-10 (4-13 s), a checkpoint at
    step 5 committed, a 2 s save stall at 10.5 s; its totals are what goodput.json last held."""
    g = Goodput(0.0)
    g.attempt_began(0, "start", 0.0, None)
    for step in range(1, 11):
        g.reported(step, 3.0 + step)
        if step == 5:
            g.checkpointed(5)
    g.save_stalled(2.0, 10.5)
    return g.snapshot(13.5)


@pytest.mark.parametrize("resumed, redone", [(5, 13.0 - 8.0 - 2.0), (8, 13.0 - 11.0), (10, 0.0), (None, 13.0 - 4.0 - 2.0)])
def test_a_rerun_after_a_killed_driver_counts_the_steps_it_runs_again_as_redone(resumed, redone):
    before = _killed_driver_call()
    assert before["badput_s"]["redone steps"] == 0.0 and before["unkept"] is not None
    g = Goodput(1000.0, carried=before)
    g.attempt_began(0, "rerun" if resumed is not None else "start", 1000.0, resumed)
    snapshot = g.snapshot(1000.0)
    assert snapshot["badput_s"]["redone steps"] == pytest.approx(redone)
    assert snapshot["productive_s"] == pytest.approx(before["productive_s"] - redone)
    assert snapshot["wall_s"] == pytest.approx(before["wall_s"])
    # counted once: the rerun's own later snapshots carry no second move
    g.reported(resumed or 1, 1003.0)
    assert g.snapshot(1004.0)["badput_s"]["redone steps"] == pytest.approx(redone)


def test_a_call_that_ended_leaves_nothing_unkept_and_a_long_tail_is_thinned():
    assert _run().snapshot(30.0)["unkept"] is None
    g = Goodput(0.0)
    g.attempt_began(0, "start", 0.0, None)
    for step in range(1, 5001):
        g.reported(step, float(step))
    unkept = g.snapshot(5000.0)["unkept"]
    assert len(unkept["steps"]) == 256 and unkept["steps"][0] == [1.0, 4999.0] and unkept["steps"][-1] == [5000.0, 0.0]
    rerun = Goodput(6000.0, carried=g.snapshot(5000.0))
    rerun.attempt_began(0, "rerun", 6000.0, 2500)  # thinned: the nearest kept step at or below 2500
    moved = rerun.snapshot(6000.0)["badput_s"]["redone steps"]
    assert 5000.0 - 2500.0 <= moved <= 5000.0 - 2500.0 + 5000.0 / 255


def test_a_loop_that_makes_no_reports_is_productive_from_its_engine_steps():
    g = Goodput(0.0)
    g.attempt_began(0, "start", 0.0, None)
    g.engine_stepped(1, 5.0)                # first round with a step: a report may still be on its way
    assert g.snapshot(5.5)["productive_s"] == 0.0
    g.engine_stepped(3, 6.0)                # the next round, still no report: productive since 5 s
    g.engine_stepped(3, 6.5)                # no new step: nothing
    g.engine_stepped(5, 7.0)
    g.checkpointed(3)
    g.failed(9.0)                           # last step seen at 7 s: 2 s of detection
    g.attempt_began(1, "worker died", 9.0, 3)   # steps 4-5 run again: 6-7 s
    g.engine_stepped(4, 12.0)
    g.engine_stepped(6, 13.0)
    g.ended(14.0, 6, failed=False)
    snapshot = g.snapshot(14.0)
    badput = snapshot["badput_s"]
    assert badput["start-up"] == pytest.approx(5.0) and badput["failure detection"] == pytest.approx(2.0)
    assert badput["redone steps"] == pytest.approx(1.0) and badput["restart"] == pytest.approx(3.0)
    assert badput["shutdown"] == pytest.approx(1.0)
    assert snapshot["productive_s"] == pytest.approx((7.0 - 5.0 - 1.0) + (13.0 - 12.0))
    assert sum(badput.values()) + snapshot["productive_s"] == pytest.approx(14.0)


def test_a_reporting_loop_is_timed_by_its_reports_not_its_heartbeats():
    g = Goodput(0.0)
    g.attempt_began(0, "start", 0.0, None)
    g.engine_stepped(1, 5.0)                # the heartbeat came first
    g.reported(1, 5.2)
    g.engine_stepped(3, 6.0)                # ignored: the loop reports
    g.reported(2, 6.2)
    g.reported(3, 7.2)
    g.ended(8.2, 3, failed=False)
    snapshot = g.snapshot(8.2)
    assert snapshot["badput_s"]["start-up"] == pytest.approx(5.2)
    assert snapshot["productive_s"] == pytest.approx(2.0) and snapshot["badput_s"]["shutdown"] == pytest.approx(1.0)


def test_a_first_report_slower_than_two_heartbeat_rounds_still_times_the_loop_by_its_reports():
    """CI: under load two heartbeat rounds with engine steps came before the first report; the
    engine's head start (the end of step 1's loop body) was counted productive in each attempt."""
    g = Goodput(0.0)
    g.attempt_began(0, "start", 0.0, None)
    g.engine_stepped(1, 5.0)
    g.engine_stepped(2, 5.4)                # two rounds, no report yet: productive since 5 s for now
    g.save_stalled(0.1, 5.5)                # a stall seen in that window stays a stall
    g.reported(1, 6.0)                      # the report arrives: the loop is timed by its reports
    g.reported(2, 7.0)
    g.failed(8.0)
    g.attempt_began(1, "worker died", 8.0, None)
    g.engine_stepped(1, 10.0)
    g.engine_stepped(2, 10.5)
    g.reported(1, 11.0)
    g.reported(2, 12.0)
    g.ended(12.0, 2, failed=False)
    snapshot = g.snapshot(12.0)
    badput = snapshot["badput_s"]
    assert badput["start-up"] == pytest.approx(6.0 - 0.1) and badput["checkpoint stall"] == pytest.approx(0.1)
    assert badput["restart"] == pytest.approx(3.0) and badput["redone steps"] == pytest.approx(1.0)
    assert snapshot["productive_s"] == pytest.approx(1.0)
    assert sum(badput.values()) + snapshot["productive_s"] == pytest.approx(12.0)


def test_a_loop_that_never_checkpoints_keeps_the_accountant_small_and_the_redone_time_close():
    """bench/longrun.py (issue 35): rank 0's step times since the newest checkpoint were kept one list
    entry each (two Python floats, ~64 bytes a step): a loop that never checkpoints grew the controller
    by ~6 MiB per 100,000 steps. Now a bounded, evenly thinned record: what a failure moves to
    `redone steps` is late by at most a 2048th of the span."""
    import tracemalloc

    steps = 200_000
    g = Goodput(0.0)
    g.attempt_began(0, "start", 0.0, None)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for step in range(1, steps + 1):
            g.reported(step, float(step))   # a step a second
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 256 << 10, f"{grown / 2**20:.1f} MiB for {steps} reports"  # ~12 MiB when each step was kept
    g.checkpointed(150_000)                 # step times before it are dropped; the span starts afresh
    for step in range(steps + 1, steps + 101):
        g.reported(step, float(step))
    g.failed(float(steps + 100))
    g.attempt_began(1, "worker died", float(steps + 100), 150_000)
    redone = g.snapshot(float(steps + 100))["badput_s"]["redone steps"]
    exact = float(steps + 100 - 150_000)   # from step 150,000's report to the last
    assert exact <= redone <= exact + steps / 2048, (redone, exact)
