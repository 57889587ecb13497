"""When rayzero checkpoints a running run by itself (`checkpoint.interval` in the config).

[Note: a checkpoint interval from the numbers]
A checkpoint costs the loop C seconds of stall each time; a failure costs the work since the last
checkpoint, on average half an interval. Young (1974) and Daly (2006): the interval that loses the
least is about T = sqrt(2 x C x M), M the mean time between failures.

C is a moving average of the save stalls the ranks report in their heartbeats ([Note: goodput
accounting]); PRIOR_STALL_S until the run has measured one.

M is one over the failure rate, the larger of two estimates from the n failures the run has seen in
W seconds of its wall time (all its `fit` calls together):
- the fleet's: a Gamma prior worth one failure at M0 = 1 / (nodes x `failures_per_node_day`)
  (Llama 3's published rate by default), updated with the run's count: (1 + n) / (M0 + W);
- the run's own: (n + 1/2) / W, the posterior mean under Jeffreys' prior, i.e. what the run's
  record alone says: n failures in W seconds, and a run that has not failed in W seconds is rated
  at one failure per 2W.
Why both, and the larger: the fleet's estimate alone weighs its prior as M0 seconds of evidence,
months on a small cluster, so a run that fails every minute moves it by next to nothing for months
(the first `auto` in bench/README.md's chaos comparison asked for a checkpoint hours apart, took none
before its driver was killed at 96 s and lost 1,494 steps). The run's own estimate follows the
run's failures from the first one, and before any failure it bounds the interval: with M = 2W,
T = 2 sqrt(C x W), so the first checkpoint comes once the run has been up about 4C, and the
interval grows with the square root of the run's age until W passes M0 (a few hours on a
thousand nodes), when the fleet's rate is the larger and governs. The larger rate is the cautious
side on purpose, because the two errors cost differently: a run as reliable as the fleet that
checkpoints on its own early rate pays a stall of sqrt(C x W) seconds in all over its first W
seconds (0.8 % of the first day at C = 5 s), while a run that fails every minute and checkpoints
on the fleet's rate keeps nothing. With W >> M0 the two estimates agree (both tend to n / W).

Failures count across the run's calls, as goodput does: the controller writes n, C and whether its
call is still going beside the goodput figures (`<run>/goodput.json`, under RECORD_KEY); a rerun
reads them back, and a previous call that never wrote that it ended (its driver was killed) counts
as one more failure. Planned stops, resizes and preemptions are not failures: they checkpoint at a
boundary and lose nothing.

The controller asks the ranks for a checkpoint at the next step boundary they all reach once an
interval has passed since the newest committed checkpoint (the loop's own saves count) or the
attempt's start, as `rayzero checkpoint now` does, one at a time; the loop's own saves go on
unchanged. A number instead of "auto" is a fixed interval in seconds; null leaves checkpointing to
the loop. DeepSpeed has no such key: the design is rayzero's.
"""
from __future__ import annotations

import math
from typing import Any

PRIOR_STALL_S = 5.0  # C before the run has measured a save
SMOOTHING = 0.3  # weight of the newest measured stall in C's moving average
RECORD_KEY = "checkpoint_interval"  # the run's failure record, beside the goodput figures
DAY_S = 86_400.0


class CheckpointInterval:
    """[Note: a checkpoint interval from the numbers]."""

    def __init__(self, setting: str | float | None, failures_per_node_day: float,
                 carried: dict[str, Any] | None = None) -> None:
        self.setting = setting
        self._rate = failures_per_node_day
        record = (carried or {}).get(RECORD_KEY) or {}
        # failures of the run's earlier calls, and one for an earlier call that died without ending
        self.earlier_failures = int(record.get("failures") or 0) + (1 if record.get("running") else 0)
        stall = record.get("save_stall_s")
        self._stall_s: float | None = float(stall) if stall else None  # moving average of measured save stalls

    @property
    def active(self) -> bool:
        return self.setting is not None

    def saved(self, stall_s: float) -> None:
        """One save stalled the loop `stall_s` seconds."""
        if stall_s > 0:
            self._stall_s = stall_s if self._stall_s is None else (
                SMOOTHING * stall_s + (1 - SMOOTHING) * self._stall_s)

    @property
    def stall_s(self) -> float:
        """C: the measured moving average, or the prior before any save was measured."""
        return self._stall_s if self._stall_s is not None else PRIOR_STALL_S

    def fleet_mtbf_s(self, nodes: int) -> float:
        """M0: the prior mean time between failures of `nodes` nodes."""
        return DAY_S / (max(1, nodes) * self._rate)

    def failure_rates(self, nodes: int, failures: int, wall_s: float) -> tuple[float, float]:
        """(the fleet's, the run's own) estimate of failures per second; `failures`: this call's (the
        earlier calls' are added), `wall_s`: the run's wall time, earlier calls included."""
        count, wall = self.earlier_failures + max(0, failures), max(0.0, wall_s)
        fleet_rate = (1 + count) / (self.fleet_mtbf_s(nodes) + wall)
        own_rate = (count + 0.5) / wall if wall > 0 else 0.0
        return fleet_rate, own_rate

    def mean_time_between_failures_s(self, nodes: int, failures: int, wall_s: float) -> float:
        """M: one over the larger of the two rates."""
        return 1.0 / max(self.failure_rates(nodes, failures, wall_s))

    def seconds(self, nodes: int, failures: int, wall_s: float) -> float | None:
        """The interval in use now (None: the loop decides)."""
        if self.setting is None:
            return None
        if self.setting != "auto":
            return float(self.setting)
        return math.sqrt(2.0 * self.stall_s * self.mean_time_between_failures_s(nodes, failures, wall_s))

    def record(self, failures: int, ended: bool) -> dict[str, Any]:
        """What a rerun of the run needs (kept with the goodput figures): the failures so far, C, and
        whether this call is still going (a killed driver's never says it ended)."""
        return {RECORD_KEY: {"failures": self.earlier_failures + max(0, failures), "save_stall_s": self._stall_s,
                             "running": not ended}}

    def describe(self, nodes: int, failures: int, wall_s: float) -> dict[str, str]:
        """For `rayzero status`: the interval and, for "auto", its inputs."""
        interval = self.seconds(nodes, failures, wall_s)
        if interval is None:
            return {}
        out = {"checkpoint_interval_s": f"{interval:.0f}"}
        if self.setting == "auto":
            stall = f"{self._stall_s:.2f} s measured" if self._stall_s is not None else f"{PRIOR_STALL_S:g} s prior"
            fleet_rate, own_rate = self.failure_rates(nodes, failures, wall_s)
            source = "the run's own record" if own_rate > fleet_rate else "the fleet prior and the run's record"
            out["checkpoint_interval_inputs"] = (
                f"sqrt(2 x C x M): C {stall}, M {_duration(1.0 / max(fleet_rate, own_rate))} from {source} "
                f"({self.earlier_failures + max(0, failures)} failure(s) in {_duration(wall_s)} of the run; "
                f"the prior {self._rate:.4g} per node-day on {nodes} node(s) is one every "
                f"{_duration(self.fleet_mtbf_s(nodes))})")
        return out


def _duration(seconds: float) -> str:
    for unit, size in (("d", DAY_S), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"
