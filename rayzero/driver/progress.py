"""The driver's periodic progress line: step, loss, samples/s, tokens/s, memory per rank, and
with offload where rank 0's model state lives (device / host / NVMe bytes).

Rates come from rank 0's reports: `samples` / `tokens` (cumulative over all ranks) when the loop
reports them, else `step` times the config's `train_batch_size` for samples. Memory is each rank's
peak (GPU max allocated on GPU, else peak RSS), stamped by the worker on every report.

After a restart the loop re-runs the steps since the checkpoint it resumed from, so rank 0's step goes
back: the line printed at once then names that checkpoint, and rates are measured afresh from there
(they would otherwise mix two attempts and could even turn negative).

`restarts N` is the count the controller had charged when the reported step's attempt began (its
`AttemptStart.failures`), not its count when the driver prints: one poll can bring a later attempt's
failures with an earlier attempt's reports, and only the controller knows which causes it charges.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rayzero.controller import throughput
from rayzero.controller.status import AttemptStart
from rayzero.workers.session import Report


def _position(report: Report) -> str:
    """Where rank 0 is: its reported `step`, else the report's number (never a sequence number that
    reads as a step: a loop's first report after a resume may carry no step)."""
    step = report.metrics.get("step")
    return f"step {step}" if step is not None else f"report {report.seq}"


def _human_duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def goodput_line(snapshot: dict[str, Any]) -> str:
    """`goodput 93.2% of 1h02m00s; start-up 4.1%, restart 1.2%, ...` ([Note: goodput accounting])."""
    wall = snapshot.get("wall_s") or 0.0
    if not wall or snapshot.get("goodput") is None:
        return "goodput: not measured (no wall time yet)"
    causes = sorted(((cause, seconds) for cause, seconds in (snapshot.get("badput_s") or {}).items() if seconds > 0),
                    key=lambda item: -item[1])
    parts = ", ".join(f"{cause} {100 * seconds / wall:.1f}%" for cause, seconds in causes)
    return f"goodput {100 * snapshot['goodput']:.1f}% of {_human_duration(wall)}" + (f"; {parts}" if parts else "")


def _human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f}{unit}" if unit in ("B", "KiB", "MiB") else f"{count:.1f}{unit}"
        count /= 1024
    return f"{count:.1f}GiB"


def _human_rate(value: float) -> str:
    return f"{value / 1000:.1f}k" if value >= 10_000 else f"{value:.1f}"


class Progress:
    """Turns reports into progress lines and the summary's throughput figures."""

    def __init__(
        self,
        train_batch_size: int | None,
        interval_s: float,
        phase_keys: bool,
        emit: Callable[[str], None] = print,
    ) -> None:
        self._batch = train_batch_size  # samples per optimizer step over all ranks, if known
        self._interval_s = interval_s
        self._phase_keys = phase_keys  # wall_clock_breakdown: show *_ms metrics on the line
        self._emit = emit
        self._memory: dict[int, int] = {}  # rank -> newest peak memory
        self._placement: dict[str, int] | None = None  # rank 0's device/host/nvme state bytes
        self._first: Report | None = None  # rank 0's first report: rates are measured from it
        self._last: Report | None = None
        self._printed_at = float("-inf")  # the first report prints at once
        self._resumed_from: str | None = None  # where rank 0 went back to ("step 3"), until a line has said so
        self._attempt_resumed: dict[int, int | None] = {}  # attempt -> the checkpoint step it began from
        self._attempt_failures: dict[int, int] = {}  # attempt -> restarts charged when it began
        self._resumed_checkpoint: int | None = None  # what the restart being said resumed from
        self._said = ""  # the last line emitted (the summary does not repeat it)
        self.max_failures = 0  # FailureConfig.max_failures (set by the driver; -1: no limit)
        self.stragglers: list[int] = []  # ranks the controller reported as stragglers (set by the driver)
        self.goodput: dict[str, Any] | None = None  # the controller's newest goodput snapshot (set by the driver)

    def attempt_began(self, start: AttemptStart) -> None:
        """An attempt's start, as the controller began it: the restart line names the checkpoint it
        resumed from. Not the newest checkpoint known when its first report arrives: by then the new
        attempt may have committed one itself (the chaos soak's line said "resumed from the
        checkpoint of step 150" at step 139 after resuming from 138). Kept per attempt: one poll
        can bring two attempts' starts before the first one's reports (a failure two steps after a
        restart, within one long poll). Its restart count likewise: the controller's count when the
        poll returns already holds that later failure."""
        self._attempt_resumed[start.attempt] = start.resumed_step
        self._attempt_failures[start.attempt] = start.failures

    def observe(self, item: Report) -> None:
        self._memory[item.rank] = item.peak_memory_bytes
        if item.rank == 0 and item.placement is not None:
            self._placement = item.placement
        if item.rank != 0:
            return
        if self._first is None or throughput.went_back(item, self._last):
            self._first = item
        resumed = self._first is item and self._last is not None
        if resumed:
            self._resumed_from = _position(item)
            self._resumed_checkpoint = self._attempt_resumed.get(item.attempt)
        self._last = item
        now = time.monotonic()
        if resumed or now - self._printed_at >= self._interval_s:
            self._printed_at = now
            self._said = self.line()
            self._emit(self._said)

    def rates(self) -> dict[str, float]:
        """samples/s and tokens/s between rank 0's first and newest report (what could be measured)."""
        return throughput.rates(self._first, self._last, self._batch)

    def line(self) -> str:
        if self._last is None:
            return "[rayzero] waiting for the first report"
        metrics = self._last.metrics
        parts = [_position(self._last)]
        if self._resumed_from is not None:
            parts[0] += (f" (restarted: resumed from the checkpoint of step {self._resumed_checkpoint})"
                         if self._resumed_checkpoint is not None else
                         f" (restarted: no checkpoint known, the loop went back to {self._resumed_from})")
            self._resumed_from = None
        loss = metrics.get("loss")
        if isinstance(loss, (int, float)):
            parts.append(f"loss {loss:.4f}")
        rates = self.rates()
        if "samples_per_s" in rates:
            parts.append(f"{_human_rate(rates['samples_per_s'])} samples/s")
        if "tokens_per_s" in rates:
            parts.append(f"{_human_rate(rates['tokens_per_s'])} tokens/s")
        if self._phase_keys:
            phases = [f"{key} {value:.1f}" for key, value in metrics.items()
                      if key.endswith("_ms") and isinstance(value, (int, float))]
            parts.extend(phases)
        memory = " ".join(f"r{rank} {_human_bytes(self._memory[rank])}" for rank in sorted(self._memory))
        parts.append(f"mem {memory}")
        where = self._placement
        if where and (where.get("host_bytes") or where.get("nvme_bytes")):  # only with offload
            parts.append("state r0 " + " ".join(f"{key[:-6]} {_human_bytes(where[key])}" for key in
                                                ("device_bytes", "host_bytes", "nvme_bytes") if where.get(key)))
        failures = self._attempt_failures.get(self._last.attempt, 0)
        if failures:
            parts.append(f"restarts {failures}" + (f"/{self.max_failures}" if self.max_failures >= 0 else ""))
        if self.stragglers:
            parts.append("straggler " + " ".join(f"r{rank}" for rank in self.stragglers))
        return "[rayzero] " + " | ".join(parts)

    def final_line(self) -> str | None:
        """The closing progress line, or None when the last line printed says the same."""
        line = self.line()
        return None if line == self._said else line

    def peak_memory(self) -> dict[int, int]:
        return dict(self._memory)
