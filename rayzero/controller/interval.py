"""When rayzero checkpoints a running run by itself (`checkpoint.interval` in the config).

[Note: a checkpoint interval from the numbers]
A checkpoint costs the loop C seconds of stall each time; a failure costs the work since the last
checkpoint, on average half an interval. Young (1974) and Daly (2006): the interval that loses the
least is about sqrt(2 x C x M), M the mean time between failures. rayzero measures C (a moving
average of the save stalls the ranks report in their heartbeats: [Note: goodput accounting]) and
estimates M from a prior and what the run has seen: the prior is one failure per M0 = 1 / (nodes x
`failures_per_node_day`) (Llama 3's published rate by default), and with n failures in W seconds of
the run's wall time the estimate is (M0 + W) / (1 + n), the mean of a Gamma prior worth one
failure updated by the run's own count. So a run that fails often checkpoints more often, and one
that never fails drifts toward its observed (longer) M. The controller asks the ranks for a
checkpoint at the next step boundary they all reach once an interval has passed since the newest
committed checkpoint (the loop's own saves count), as `rayzero checkpoint now` does; the loop's
own saves go on unchanged. A number instead of "auto" is a fixed interval in seconds; null leaves
checkpointing to the loop.
"""
from __future__ import annotations

import math

PRIOR_STALL_S = 5.0  # C before the run has measured a save
SMOOTHING = 0.3  # weight of the newest measured stall in C's moving average


class CheckpointInterval:
    """[Note: a checkpoint interval from the numbers]."""

    def __init__(self, setting: str | float | None, failures_per_node_day: float) -> None:
        self.setting = setting
        self._rate = failures_per_node_day
        self._stall_s: float | None = None  # moving average of measured save stalls

    @property
    def active(self) -> bool:
        return self.setting is not None

    def saved(self, stall_s: float) -> None:
        """One save stalled the loop `stall_s` seconds."""
        if stall_s > 0:
            self._stall_s = stall_s if self._stall_s is None else (
                SMOOTHING * stall_s + (1 - SMOOTHING) * self._stall_s)

    def mean_time_between_failures_s(self, nodes: int, failures: int, wall_s: float) -> float:
        prior = 86_400.0 / (max(1, nodes) * self._rate)
        return (prior + max(0.0, wall_s)) / (1 + max(0, failures))

    def seconds(self, nodes: int, failures: int, wall_s: float) -> float | None:
        """The interval in use now (None: the loop decides)."""
        if self.setting is None:
            return None
        if self.setting != "auto":
            return float(self.setting)
        stall = self._stall_s if self._stall_s is not None else PRIOR_STALL_S
        return math.sqrt(2.0 * stall * self.mean_time_between_failures_s(nodes, failures, wall_s))

    def describe(self, nodes: int, failures: int, wall_s: float) -> dict[str, str]:
        """For `rayzero status`: the interval and, for "auto", its inputs."""
        interval = self.seconds(nodes, failures, wall_s)
        if interval is None:
            return {}
        out = {"checkpoint_interval_s": f"{interval:.0f}"}
        if self.setting == "auto":
            stall = f"{self._stall_s:.2f} s measured" if self._stall_s is not None else f"{PRIOR_STALL_S:g} s prior"
            mtbf = self.mean_time_between_failures_s(nodes, failures, wall_s)
            out["checkpoint_interval_inputs"] = (
                f"sqrt(2 x C x M): C {stall}, M {mtbf / 3600:.1f} h ({failures} failure(s) in "
                f"{wall_s / 3600:.2f} h on {nodes} node(s); prior {self._rate:.4g} per node-day)")
        return out
