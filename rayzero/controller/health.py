"""Hang detection from per-rank heartbeats: a pure function of what the ranks last said.

[Note: hang detection]
A rank's heartbeat (rayzero.workers.boundary.Heartbeat) carries how long ago it last made progress
(an engine forward or step, a report, a boundary save). A rank is hung when that age passes its
limit: `startup_grace_s` before its first optimizer step (model build, data loading, first
compile), afterwards `max(hang_timeout_s, multiple × its median step time)` so a slow model is not
called hung. A rank writing a boundary checkpoint, or whose loop returned, is never hung. When any
rank is hung the culprit is the one *behind*: the fewest steps, then one that is not inside an
engine step (the others are inside, blocked in a collective waiting for it), then the fewest micro
steps, then the oldest progress. A rank that does not
answer its heartbeat at all for the same limit is hung too (its process is wedged outside Python).
The controller hears every rank once per heartbeat round (`heartbeat_interval_s`, 1 s) through its
node's relay ([Note: node relays] in rayzero/workers/relay.py), and rounds keep that interval
whatever a rank does (a relay waits at most `RELAY_WAIT_S` for a silent rank, and a poll no longer
than the next round is due), so a hang is acted on at most one interval after its limit: within
56 s at the default `hang_timeout_s` of 55 s; the report with the ranks' stacks follows (~2 s).
"""
from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from rayzero.workers.boundary import Heartbeat


@dataclass(frozen=True)
class HangPolicy:
    hang_timeout_s: float = 55.0
    """No progress for this long after the first step is a hang (0 disables hang detection)."""
    startup_grace_s: float = 600.0
    """Before a rank's first optimizer step, the limit is this instead."""
    multiple: float = 10.0
    """Adaptive floor: the limit is at least this many median step times."""

    def limit(self, beat: Heartbeat | None) -> float:
        if beat is None or not beat.stepped:
            return self.startup_grace_s
        step_time = beat.step_time_s or 0.0
        return max(self.hang_timeout_s, self.multiple * step_time)


@dataclass(frozen=True)
class Hang:
    culprit: int
    """The rank blamed (behind the others, or silent)."""
    ages: dict[int, float]
    """Every rank's seconds without progress."""
    reason: str


def find_hang(beats: dict[int, Heartbeat | None], silent_for: dict[int, float], policy: HangPolicy) -> Hang | None:
    """A `Hang` when some rank exceeded its limit ([Note: hang detection]), else None.

    `beats`: each rank's newest heartbeat (None when it never answered); `silent_for`: seconds since
    each rank last answered a heartbeat call at all."""
    if policy.hang_timeout_s <= 0:
        return None
    ages: dict[int, float] = {}
    hung: list[int] = []
    for rank, beat in beats.items():
        if beat is not None and (beat.finished or beat.saving):
            continue
        age = max(beat.progress_age_s if beat is not None else 0.0, silent_for.get(rank, 0.0))
        ages[rank] = age
        if age > policy.limit(beat):
            hung.append(rank)
    if not hung:
        return None

    def behind(rank: int) -> tuple[int, bool, int, float]:
        beat = beats.get(rank)
        if beat is None:
            return (-1, False, -1, -ages[rank])
        return (beat.step, beat.in_step, beat.micro_step, -ages[rank])

    culprit = min(ages, key=behind)
    beat = beats.get(culprit)
    where = (f"at step {beat.step} (micro step {beat.micro_step}, {'inside' if beat.in_step else 'outside'} an "
             "engine step)") if beat is not None else "before its first heartbeat"
    limit = policy.limit(beat)
    silent = silent_for.get(culprit, 0.0)
    if silent >= limit:  # not blocked in Python: the process itself does not run
        where += (f" and stopped answering its heartbeats {silent:.0f}s ago (the process is stopped, e.g. "
                  "SIGSTOP or a debugger, or wedged outside Python)")
    reason = (f"rank {culprit} made no progress for {ages[culprit]:.0f}s {where} (limit {limit:.0f}s: "
              f"FailureConfig.hang_timeout_s / --hang-timeout, at least {policy.multiple:g}x the median step time); "
              f"seconds without progress per rank: " + _ages_text(ages))
    return Hang(culprit, ages, reason)


# [Note: hang reports at scale]
# A hang report names every rank, and at 4,096 ranks one line per rank (or one stack dump per rank,
# 2-5 kB each) is megabytes in the driver's log that nobody reads. Ranks are grouped instead: by
# whole seconds without progress, and by stack dump (numbers that differ between processes, such as
# thread idents and addresses, ignored), each group written once with its ranks as ranges. The
# report then grows with the number of distinct situations, not with the ranks.

def rank_ranges(ranks: Iterable[int]) -> str:
    """`[0, 1, 2, 5, 7, 8]` -> `"0-2, 5, 7-8"`."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(f"{first}" if first == last else f"{first}-{last}" for first, last in spans)


def _ages_text(ages: dict[int, float]) -> str:
    """`ranks: seconds` per whole number of seconds, the longest first ([Note: hang reports at scale])."""
    by_age: dict[int, list[int]] = {}
    for rank, age in ages.items():
        by_age.setdefault(round(age), []).append(rank)
    return "; ".join(f"{rank_ranges(ranks)}: {age}" for age, ranks in sorted(by_age.items(), reverse=True))


_PER_PROCESS = re.compile(r"\b(?:0x[0-9a-fA-F]+|\d{5,})\b")  # thread idents, addresses, pids


def stacks_text(stacks: dict[int, str], culprit: int) -> str:
    """Every rank's stacks for a hang report: the culprit's first, then each distinct dump once with
    the ranks that showed it ([Note: hang reports at scale])."""
    blocks = [f"--- rank {culprit} Python stacks (culprit) ---\n{stacks[culprit]}"] if culprit in stacks else []
    same: dict[str, list[int]] = {}
    first_text: dict[str, str] = {}
    for rank in sorted(stacks):
        if rank != culprit:
            key = _PER_PROCESS.sub("#", stacks[rank])
            same.setdefault(key, []).append(rank)
            first_text.setdefault(key, stacks[rank])
    for key, ranks in same.items():  # in order of each group's lowest rank
        label = (f"rank {ranks[0]}" if len(ranks) == 1
                 else f"ranks {rank_ranges(ranks)} ({len(ranks)} ranks, the same stacks; rank {ranks[0]}'s shown)")
        blocks.append(f"--- {label} Python stacks ---\n{first_text[key]}")
    return "\n".join(blocks)


# [Note: stragglers]
# In synchronous data parallelism every rank steps at the pace of the slowest, so step intervals are
# the same on all ranks and cannot name a straggler. What differs is where the time goes: the slow
# rank spends it in its own work (data loading, the loop outside the engine: `Heartbeat.loop_time_s`,
# a median over its recent steps), the others spend it waiting in the next collective. A rank is a
# straggler when its loop time is at least `factor` (1.5) times the median over the ranks and the
# excess is a real share of the step (`min_share` of the median step time, so microseconds against
# microseconds are not reported), in `rounds` consecutive heartbeat rounds. Reported, not acted on:
# the run goes on (the driver prints it; `Result.stragglers`). Compute slower on one device (a
# throttled GPU) shows as time inside the engine and is not measured here.


@dataclass(frozen=True)
class StragglerPolicy:
    factor: float = 1.5
    """A rank whose loop time is at least this many times the median is slow."""
    min_share: float = 0.1
    """... and the excess is at least this share of the median step time."""
    rounds: int = 3
    """... in this many consecutive heartbeat rounds (persistently, not one slow batch)."""


@dataclass(frozen=True)
class Straggler:
    """A rank persistently slower than the others ([Note: stragglers])."""

    rank: int
    node_id: str
    attempt: int
    loop_time_s: float
    """Its median time per step outside the engine."""
    median_loop_time_s: float
    """The median of that over every rank."""
    step_time_s: float
    """The median step time (every rank waits for the straggler)."""

    def describe(self) -> str:
        ratio = self.loop_time_s / self.median_loop_time_s if self.median_loop_time_s > 0 else float("inf")
        return (f"straggler: rank {self.rank} (node {self.node_id[:12]}) spends {self.loop_time_s:.3f}s per step "
                f"outside the engine, {ratio:.1f}x the median {self.median_loop_time_s:.3f}s of the ranks; "
                f"every rank waits for it (step time {self.step_time_s:.3f}s)")


def slow_ranks(beats: dict[int, Heartbeat | None], policy: StragglerPolicy) -> dict[int, tuple[float, float, float]]:
    """Ranks slow in this heartbeat round: rank -> (its loop time, median loop time, median step time).
    A pure function of one round; the controller asks for `policy.rounds` rounds in a row."""
    timed = {rank: beat for rank, beat in beats.items()
             if beat is not None and beat.loop_time_s is not None and not beat.finished}
    steps = [beat.step_time_s for beat in timed.values() if beat.step_time_s]
    if len(timed) < 2 or not steps:
        return {}
    median_loop = statistics.median(beat.loop_time_s or 0.0 for beat in timed.values())
    step_time = statistics.median(steps)
    return {rank: (beat.loop_time_s or 0.0, median_loop, step_time) for rank, beat in timed.items()
            if (beat.loop_time_s or 0.0) >= policy.factor * median_loop
            and (beat.loop_time_s or 0.0) - median_loop >= policy.min_share * step_time}
