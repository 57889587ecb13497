"""The stage-3 module trace: record once, replay with a cursor, re-record on divergence."""
from __future__ import annotations

from rayzero.engine.stage3.trace import FetchEvent, ModuleTrace

NUMEL = {0: 10, 1: 20, 2: 30, 3: 40}


def event(module: int, phase: str, *params: int) -> FetchEvent:
    return FetchEvent((module, phase), params)


STEP = [event(0, "forward", 0), event(1, "forward", 1, 2), event(2, "forward", 3),
        event(2, "backward", 3), event(1, "backward", 1, 2), event(0, "backward", 0)]


def recorded() -> ModuleTrace:
    trace = ModuleTrace(NUMEL.__getitem__)
    trace.begin_micro_step()
    for item in STEP:
        assert not trace.observe(item)  # recording: nothing to match yet
    trace.begin_micro_step()
    return trace


def test_nothing_is_predicted_while_recording():
    trace = ModuleTrace(NUMEL.__getitem__)
    trace.begin_micro_step()
    trace.observe(STEP[0])
    assert list(trace.upcoming()) == [] and trace.reuse_distance(0) is None
    assert not trace.complete


def test_replay_predicts_the_next_events_and_reuse_distance():
    trace = recorded()
    assert trace.complete
    assert trace.observe(STEP[0])
    assert list(trace.upcoming()) == STEP[1:]
    assert trace.observe(STEP[1]) and trace.observe(STEP[2])
    # param 3 is fetched again by the very next event: nothing in between
    assert trace.reuse_distance(3) == 0
    # param 0's next use is the last event: params 3, 1, 2 (40 + 20 + 30) are fetched before it
    assert trace.reuse_distance(0) == 90
    assert trace.observe(STEP[3]) and trace.observe(STEP[4]) and trace.observe(STEP[5])
    assert trace.reuse_distance(0) is None  # no later use in this micro-step


def test_divergence_drops_the_trace_and_records_again():
    trace = recorded()
    assert trace.observe(STEP[0])
    other = event(3, "forward", 2)
    assert not trace.observe(other)
    assert trace.invalidations == 1 and not trace.complete
    assert list(trace.upcoming()) == []
    trace.observe(STEP[2])
    trace.begin_micro_step()  # the new recording (known prefix + what followed) becomes the trace
    assert trace.complete
    assert trace.observe(STEP[0]) and trace.observe(other) and trace.observe(STEP[2])
