"""The failures the controller sees, and the policy that decides what to do about them (the states
themselves, and `RunState`, are in states.py).

[Note: decisions as data]
Policies never act: `FailurePolicy.decide` is a pure function from (failure, failures so far) to a
decision value (`Retry` or `Fail`), and only `Controller.step()` carries decisions out. A scaling
policy (grow/shrink between min and max workers) will plug in the same way with a `Resize`
decision; tests queue decisions and drive the controller one `step()` at a time.

[Note: one retry budget]
Every unplanned restart — a loop error, a dead worker or node, a hang, a placement that did not
fit — is charged once to `FailureConfig.max_failures` (default: no total limit); planned resizes and
preemptions are not failures and cost nothing. What ends a run by default is a failure that keeps
coming back: `max_failures_without_progress` (3) failures in a row with no newer committed
checkpoint between them. So a long run goes on through the odd lost node or crashed worker, as long
as it keeps checkpointing, and a bug that fails the same step every time ends it after three tries.
Each retry waits `backoff_s · 2^(n-1)` (capped at 60 s) first, n counting the failures in a row (a
newer committed checkpoint starts it at 1 again), so a cluster that is out of room gets time for an
autoscaler or a returning node instead of a burst of failed placements, while a long run's tenth
failure, hours after its ninth, waits `backoff_s` and not a minute (Kubernetes' CrashLoopBackOff
resets the same way once a container has run for a while). A rerun with the
same name resumes from the newest checkpoint either way.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class FailureKind(enum.Enum):
    LOOP_ERROR = "loop_error"  # the user's loop raised
    WORKER_DIED = "worker_died"  # the actor process or its node went away
    SETUP_ERROR = "setup_error"  # environment / process group could not be set up
    SCHEDULING = "scheduling"  # not enough resources for the placement group
    HANG = "hang"  # a rank made no progress within the hang timeout


@dataclass(frozen=True)
class Failure:
    """Something that went wrong in the worker group, as data."""

    kind: FailureKind
    """What kind of failure it was; the policy decides on it."""
    message: str
    """One line for people."""
    rank: int | None = None
    """The rank that failed, when one did."""
    traceback_text: str = ""
    """The failing rank's traceback, when there is one."""
    exit_code: int | None = None
    """A script's exit status, when a script ended with one ([Note: scripts on workers])."""


@dataclass(frozen=True)
class Retry:
    """Tear the worker group down and schedule it again (resuming from the newest checkpoint)."""

    reason: str


@dataclass(frozen=True)
class Fail:
    """Stop the run with this failure."""

    failure: Failure


@dataclass(frozen=True)
class Resize:
    """Planned: checkpoint at the agreed boundary, then regroup with `workers` ranks (no budget)."""

    workers: int
    reason: str


Decision = Retry | Fail | Resize


@dataclass(frozen=True)
class FailurePolicy:
    """Retry worker failures while the run makes progress; never retry what cannot improve
    ([Note: one retry budget])."""

    max_failures: int = -1
    """Failures tolerated over the whole run (one budget, not per rank); -1 means no total limit."""
    backoff_s: float = 0.0
    """Wait before the first retry; doubled each further retry in a row (no newer committed checkpoint
    between them), capped at 60 s."""
    max_failures_without_progress: int = 3
    """Failures in a row with no newer committed checkpoint between them that end the run (a crash
    that recurs at the same place is not fixed by another restart); 0 means no such limit."""

    def decide(self, failure: Failure, failures_so_far: int, without_progress: int = 0) -> Decision:
        """`without_progress`: failures before this one since the newest committed checkpoint."""
        if self.max_failures >= 0 and failures_so_far >= self.max_failures:
            return Fail(failure)
        if self.max_failures_without_progress and without_progress + 1 >= self.max_failures_without_progress:
            return Fail(failure)
        return Retry(f"failure {failures_so_far + 1} of {self._budget()}: {failure.message}")

    def backoff(self, failures_so_far: int) -> float:
        """Seconds to wait before a retry that is failure number `failures_so_far` in a row (1-based)."""
        if self.backoff_s <= 0 or failures_so_far <= 0:
            return 0.0
        return min(60.0, self.backoff_s * 2 ** (failures_so_far - 1))

    def _budget(self) -> str:
        total = "no total limit" if self.max_failures < 0 else str(self.max_failures)
        if not self.max_failures_without_progress:
            return total
        return f"{total}; {self.max_failures_without_progress} in a row without a new checkpoint end the run"

    def ending(self, failures: int, without_progress: int) -> str:
        """Why the run ended, and how to allow more: for the error the user sees."""
        if self.max_failures >= 0 and failures >= self.max_failures:
            why = (f"the run allows {self.max_failures} failure(s) in all (FailureConfig.max_failures / "
                   "--max-failures; -1 for no total limit)")
        else:
            why = (f"{without_progress + 1} failures in a row came without a newer checkpoint committed between them "
                   f"(FailureConfig.max_failures_without_progress={self.max_failures_without_progress}; 0 turns "
                   "this limit off)")
        return why
