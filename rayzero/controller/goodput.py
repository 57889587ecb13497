"""Goodput: the share of a run's wall time that became kept training progress, and where the rest went.

[Note: goodput accounting]
Wall time is the time `rayzero.fit` calls of the run were alive, summed over same-name reruns (a
rerun starts from the totals the previous call left in `<run>/goodput.json`; the days between two
calls are nobody's wall time). Every second of it lands in exactly one bucket:

- `productive`: a group trained (from an attempt's first step report on) and what it did was kept;
- `start-up`: the first attempt of a call (or a rerun) until its first step: Ray, workers, the
  process group, building the model, loading the checkpoint;
- `restart`: after a failure: the backoff, the new group, loading the checkpoint, until its first step;
- `failure detection`: from a failed attempt's last step report to the controller's decision (for a
  hang, the hang timeout);
- `redone steps`: steps run again after a restore: the failed attempt's time from the report of the
  step the next attempt resumed from to its last report (all of it when there was no checkpoint),
  moved out of `productive`; for a run that ends on a failure, what the last checkpoint does not keep;
- `checkpoint stall`: seconds the loop waited on saves (`engine.save_checkpoint`,
  `wait_for_checkpoint`, the ranks' cumulative count in their heartbeats), moved out of `productive`;
- `planned`: planned stops and resizes (a preemption's regroup included): from the request to the
  new group's first step, or to the end;
- `idle`: waiting for resources (the placement group's wait);
- `shutdown`: after the loops' last step: the final save's commit beyond the measured stall, the
  group's teardown.

A call that ends without saying so (its driver killed) left totals in which the steps its last
attempt ran past the newest checkpoint are productive, but the rerun runs them again. So the snapshot
also carries `unkept`: for each step the last attempt reported since its newest checkpoint (at most
`_MAX_UNKEPT` of them, evenly thinned), the productive seconds from that step's report to the last
one; the rerun's first attempt moves the figure for the step it resumes from (its largest step at or
below it; `all` when it resumes from no checkpoint) from the carried productive time to `redone steps`.
A call that ended itself (`ended()`) or whose attempt's redone part was already counted leaves none.

goodput = productive / wall. The accountant is fed by the controller at its transitions and with
rank 0's reports (or, for a loop that makes none, rank 0's engine steps from its heartbeats; when an
attempt's first report comes after the engine steps had started its productive time, that time goes
back to the bucket the attempt opened in, so a reporting loop is timed by its reports alone); it
keeps at most `_MAX_STEP_TIMES` step times since the newest checkpoint for the redone computation
(`StepTimes`: evenly thinned past that), so its memory does not grow with the run.
"""
from __future__ import annotations

import bisect
from array import array
from collections import defaultdict
from typing import Any

CAUSES = ("start-up", "restart", "failure detection", "redone steps", "checkpoint stall", "planned", "idle",
          "shutdown")
_PLANNED = ("preemption", "resize")
_MAX_STEP_TIMES = 4096  # step times kept since the newest checkpoint (a loop that never checkpoints)
_MAX_UNKEPT = 256  # steps in a snapshot's `unkept` (a thinned entry counts a little more as redone)


def _bucket_for(cause: str) -> str:
    """The bucket an attempt's start-up goes to, by why the attempt began."""
    if cause in ("start", "rerun"):
        return "start-up"
    if cause.startswith(_PLANNED):
        return "planned"
    return "restart"


class StepTimes:
    """Rank 0's (step, time) pairs since the newest checkpoint, at most `capacity` + 1 of them, as
    packed doubles (16 bytes a pair; a list of Python floats took 64). Past `capacity` every other
    pair is dropped and from then on only every `stride`-th one offered is kept (and the newest, in
    place of the previous newest), so the whole span stays covered evenly: a redone time read from
    it is early by at most one stride's time (a 2048th of the span for a loop that never
    checkpoints). Unbounded, such a loop made the controller grow by ~6 MiB per 100,000 steps."""

    def __init__(self, capacity: int = _MAX_STEP_TIMES) -> None:
        self.capacity = capacity  # even: a thinning keeps the newest pair
        self.steps = array("d")
        self.times = array("d")
        self.stride = 1  # keep every stride-th pair offered (doubles at each thinning)
        self._offered = 0  # pairs offered since the last one kept
        self._newest_only = False  # the last pair is only the newest offered: the next one replaces it

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, step: float, when: float) -> None:
        self._offered += 1
        if self._newest_only:
            self.steps[-1], self.times[-1] = step, when
        else:
            self.steps.append(step)
            self.times.append(when)
        self._newest_only = self._offered < self.stride
        if not self._newest_only:
            self._offered = 0
            if len(self.steps) > self.capacity:  # precision, not memory, is lost
                self.steps, self.times, self.stride = self.steps[::2], self.times[::2], 2 * self.stride

    def cut_before(self, step: float) -> None:
        """Drop the pairs before the newest one at or below `step` (a checkpoint at `step` committed)."""
        cut = bisect.bisect_left(self.steps, step)
        if cut > 0:
            self.steps, self.times = self.steps[cut - 1:], self.times[cut - 1:]
            self.stride, self._offered, self._newest_only = 1, 0, False  # a fresh span: the finest resolution

    def time_at_or_before(self, step: float) -> float | None:
        """When the newest kept step at or below `step` was reported (None: before the first)."""
        index = bisect.bisect_right(self.steps, step) - 1
        return self.times[index] if index >= 0 else None


class Goodput:
    """[Note: goodput accounting]. Times are the controller's clock (monotonic seconds)."""

    def __init__(self, now: float, carried: dict[str, Any] | None = None) -> None:
        carried = carried or {}
        self._wall_before = float(carried.get("wall_s", 0.0))  # earlier calls of this run
        self._seconds: dict[str, float] = defaultdict(float, {
            key: float(value) for key, value in (carried.get("seconds") or {}).items()})
        self._start = now
        self._carried_unkept: dict[str, Any] | None = carried.get("unkept")  # the previous call's tail
        self._bucket, self._since = "start-up", now
        self._per_attempt: dict[int, dict[str, float]] = {}  # this call's attempts
        self._attempt = 0
        self._last_report: float | None = None  # rank 0's newest report of the current attempt
        self._first_report: float | None = None
        self._opening = "start-up"  # the bucket the current attempt was in before its first step
        self._reporting = False  # rank 0 reported in this attempt (else its engine's steps are the signal)
        self._engine_last: tuple[int, float] | None = None  # (step, when) of its newest engine step seen
        self._steps = StepTimes()  # rank 0's reported steps in this attempt since the newest checkpoint, and when
        self._stall_seen = 0.0  # the current attempt's cumulative save stall already counted
        self._stalls: list[tuple[float, float]] = []  # (when, seconds) counted since the newest checkpoint

    # ---- the controller's events ------------------------------------------------------------
    def attempt_began(self, attempt: int, cause: str, now: float, resumed_step: int | None) -> None:
        if self._carried_unkept is not None:  # this call's first attempt redoes what the last one did not keep
            self._redo_carried(resumed_step)
        if attempt and self._first_report is not None:
            self._redo(resumed_step)  # the previous attempt's steps past the checkpoint run again
        self._switch(_bucket_for(cause), now)
        self._attempt = attempt
        self._last_report = self._first_report = None
        self._reporting, self._engine_last = False, None
        self._steps, self._stall_seen, self._stalls = StepTimes(), 0.0, []

    def placement_waited(self, seconds: float, now: float) -> None:
        """The new group's placement group took `seconds`: that part of its start was idle."""
        self._flush(now)
        spent = self._per_attempt.get(self._attempt, {}).get(self._bucket, 0.0)
        moved = min(max(0.0, seconds), max(0.0, spent))
        self._add(self._bucket, -moved)
        self._add("idle", moved)

    def reported(self, step: Any, now: float) -> None:
        """One of rank 0's reports (its `step` metric when numeric)."""
        if not self._reporting and self._first_report is not None:
            self._engine_gave_way(now)
        self._reporting = True
        self._progressed(step, now)

    def _engine_gave_way(self, now: float) -> None:
        """The attempt's first report came after its engine steps had started the productive time: a
        reporting loop is timed by its reports, so the time since the engine's start goes back to the
        bucket the attempt opened in (under load two heartbeat rounds can beat the first report)."""
        self._flush(now)
        stalled = self._stalled_after(self._first_report)
        spent = self._per_attempt.get(self._attempt, {}).get("productive", 0.0)
        moved = max(0.0, min(now - self._first_report - stalled, spent))
        self._add("productive", -moved)
        self._add(self._opening, moved)
        self._first_report = self._last_report = None
        self._steps = StepTimes()  # the engine's step numbers; the loop's own from here

    def engine_stepped(self, step: int, now: float) -> None:
        """Rank 0's engine has completed optimizer step `step` (its heartbeat): the progress signal of
        a loop that makes no reports (a DeepSpeed, Accelerate or Lightning script). It counts from the
        second heartbeat round that shows a new step with no report of the attempt yet (a reporting
        loop's first report is on its way by then), from the first such round's time."""
        if self._reporting or (self._engine_last is not None and step <= self._engine_last[0]):
            return
        previous, self._engine_last = self._engine_last, (step, now)
        if previous is None:
            return
        if self._first_report is None:
            self._progressed(*previous)
        self._progressed(step, now)

    def _progressed(self, step: Any, now: float) -> None:
        if self._first_report is None:
            self._first_report = now
            if self._bucket != "productive":
                self._opening = self._bucket
            self._switch("productive", now)
        self._last_report = now
        if isinstance(step, (int, float)) and not isinstance(step, bool):
            self._steps.add(float(step), now)

    def checkpointed(self, step: int) -> None:
        """A checkpoint at `step` is committed: step times before it are never needed again."""
        self._steps.cut_before(float(step))
        if len(self._steps):
            self._stalls = [(when, seconds) for when, seconds in self._stalls if when >= self._steps.times[0]]

    def save_stalled(self, cumulative_s: float, now: float) -> float:
        """The ranks' cumulative seconds waiting on saves in this attempt (the largest of them);
        returns the seconds not seen before."""
        fresh = max(0.0, cumulative_s - self._stall_seen)
        self._stall_seen = max(self._stall_seen, cumulative_s)
        if fresh and self._bucket == "productive":
            self._flush(now)
            fresh = min(fresh, self._seconds["productive"])
            self._seconds["productive"] -= fresh
            self._per_attempt_add("productive", -fresh)
            self._add("checkpoint stall", fresh)
            self._stalls.append((now, fresh))
        return fresh

    def failed(self, now: float) -> None:
        """The controller decided the attempt failed: the time since its last report was detection."""
        since = self._last_report if self._last_report is not None and self._bucket == "productive" else now
        self._switch("failure detection", max(since, self._since))
        self._switch("restart", now)

    def planned(self, now: float) -> None:
        """A planned stop or resize began (its checkpoint, the regroup)."""
        self._switch("planned", now)

    def ended(self, now: float, kept_step: int | None, failed: bool) -> None:
        """The run ended; on a failure, what the newest checkpoint (`kept_step`) does not keep is lost;
        after the loops finished, the time from the last step on is shutdown (or a stall, measured)."""
        if failed and self._first_report is not None:
            self._redo(kept_step)
        elif self._bucket == "productive" and self._last_report is not None:
            self._flush(now)
            stalled = self._stalled_after(self._last_report)
            tail = max(0.0, min(now - self._last_report - stalled, self._seconds.get("productive", 0.0)))
            self._add("productive", -tail)
            self._add("shutdown", tail)
        self._switch("ended", now)

    # ---- what it says -------------------------------------------------------------------------
    def snapshot(self, now: float) -> dict[str, Any]:
        seconds = dict(self._seconds)
        if self._bucket != "ended":
            seconds[self._bucket] = seconds.get(self._bucket, 0.0) + max(0.0, now - self._since)
        seconds.pop("ended", None)
        wall = self._wall_before + max(0.0, (now if self._bucket != "ended" else self._since) - self._start)
        productive = max(0.0, seconds.pop("productive", 0.0))
        badput = {cause: round(max(0.0, seconds.get(cause, 0.0)), 3) for cause in CAUSES}
        unkept = None if self._bucket == "ended" else self._unkept()
        return {"wall_s": round(wall, 3), "productive_s": round(productive, 3), "unkept": unkept,
                "goodput": round(productive / wall, 4) if wall > 0 else None, "badput_s": badput,
                "seconds": {**badput, "productive": round(productive, 3)},
                "attempts": {str(attempt): {bucket: round(value, 3) for bucket, value in buckets.items()
                                            if bucket != "ended" and round(value, 3)}
                             for attempt, buckets in self._per_attempt.items()}}

    # ---- bookkeeping ----------------------------------------------------------------------------
    def _flush(self, now: float) -> None:
        if now > self._since:
            self._add(self._bucket, now - self._since)
            self._since = now

    def _switch(self, bucket: str, now: float) -> None:
        self._flush(max(now, self._since))
        self._bucket = bucket

    def _add(self, bucket: str, seconds: float) -> None:
        if bucket == "ended":
            return
        self._seconds[bucket] += seconds
        self._per_attempt_add(bucket, seconds)

    def _per_attempt_add(self, bucket: str, seconds: float) -> None:
        buckets = self._per_attempt.setdefault(self._attempt, defaultdict(float))
        buckets[bucket] += seconds

    def _unkept(self) -> dict[str, Any] | None:
        """What a rerun would run again of the current attempt, by the step it resumes from."""
        if self._last_report is None or self._first_report is None:
            return None
        count = len(self._steps)
        picked = sorted({round(i * (count - 1) / (_MAX_UNKEPT - 1)) for i in range(_MAX_UNKEPT)}) \
            if count > _MAX_UNKEPT else range(count)
        return {"all": round(self._run_since(self._first_report), 3),
                "steps": [[self._steps.steps[i], round(self._run_since(self._steps.times[i]), 3)] for i in picked]}

    def _run_since(self, since: float) -> float:
        """Seconds the current attempt trained from `since` to its last report, less its save stalls."""
        assert self._last_report is not None
        return max(0.0, self._last_report - since - self._stalled_after(since))

    def _stalled_after(self, since: float) -> float:
        """Save-stall seconds seen after `since` (already counted as stall, not productive)."""
        return sum(seconds for when, seconds in self._stalls if when > since)

    def _redo_carried(self, resumed_step: int | None) -> None:
        """Move the previous call's unkept productive seconds (see the note) to `redone steps`."""
        unkept, self._carried_unkept = self._carried_unkept or {}, None
        steps = unkept.get("steps") or []
        seconds = float(unkept.get("all") or 0.0)
        if resumed_step is not None and steps and resumed_step >= steps[0][0]:
            index = bisect.bisect_right([step for step, _ in steps], float(resumed_step)) - 1
            seconds = float(steps[index][1])
        moved = max(0.0, min(seconds, self._seconds.get("productive", 0.0)))
        self._seconds["productive"] -= moved
        self._seconds["redone steps"] += moved

    def _redo(self, resumed_step: int | None) -> None:
        """Move the current attempt's time after `resumed_step`'s report out of productive."""
        if self._last_report is None or self._first_report is None:
            return
        kept_at = None if resumed_step is None else self._steps.time_at_or_before(float(resumed_step))
        since = self._first_report if kept_at is None else kept_at  # None: nothing of this attempt is kept
        redone = max(0.0, min(self._run_since(since), self._seconds.get("productive", 0.0)))
        self._seconds["productive"] -= redone
        self._per_attempt_add("productive", -redone)
        self._add("redone steps", redone)
        self._first_report = None  # counted once
