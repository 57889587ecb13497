"""After a restart (issue 13 item 5): one metrics row per step, marked by attempt, and a progress line
that says why the step went back."""
from __future__ import annotations

from rayzero.controller.controller import Controller
from rayzero.controller.elastic import BatchPlan
from rayzero.controller.failures import Failure, FailureKind, FailurePolicy
from rayzero.controller.status import AttemptStart
from rayzero.controller.worker_group import GroupPoll
from rayzero.driver.metrics_log import MetricsLog
from rayzero.driver.metrics_store import read_metrics
from rayzero.driver.progress import Progress
from rayzero.workers.session import Report


def _reports(rank: int, steps: range, start_time: float, attempt: int = 0) -> list[Report]:
    # a fresh worker process numbers its reports from 0: seq restarts with each attempt
    return [Report(rank=rank, seq=seq, time=start_time + step, metrics={"step": step, "loss": 10.0 - step,
                                                                         "samples": 4 * (step + 1)}, attempt=attempt)
            for seq, step in enumerate(steps)]


def _two_attempts() -> list[Report]:
    first = [r for pair in zip(_reports(0, range(5), 0), _reports(1, range(5), 0)) for r in pair]
    second = [r for pair in zip(_reports(0, range(3, 7), 100, 1), _reports(1, range(3, 7), 100, 1)) for r in pair]
    return first + second  # the checkpoint was at step 3: steps 3 and 4 are run again


def test_re_run_steps_replace_their_rows_marked_by_attempt(tmp_path):
    log = MetricsLog(tmp_path.as_uri())
    for item in _two_attempts():
        log.add(item)
    log.flush()
    assert [m["step"] for m in log.history()] == [0, 1, 2, 3, 4, 5, 6]  # rank 0, each step once
    table = read_metrics(str(tmp_path)).to_pydict()
    rows = sorted(zip(table["rank"], table["step"], table["attempt"], table["time"]))
    assert len(rows) == 14  # 7 steps x 2 ranks
    assert [(step, attempt) for rank, step, attempt, _ in rows if rank == 1] == [
        (0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (6, 1)]
    assert all(time >= 100 for _, step, _, time in rows if step >= 3)  # the newer report won


def test_a_same_name_rerun_appends_replaces_re_run_steps_and_reports_only_its_own(tmp_path):
    first = MetricsLog(tmp_path.as_uri())
    for item in _reports(0, range(5), 0) + _reports(1, range(5), 0):
        first.add(item)
    first.flush()
    rerun = MetricsLog(tmp_path.as_uri())  # a new fit with the same name: resumes at step 3
    for item in _reports(0, range(3, 7), 100) + _reports(1, range(3, 7), 100):
        rerun.add(item)
    rerun.flush()
    assert [m["step"] for m in rerun.history()] == [3, 4, 5, 6]  # this run's reports, each step once
    assert [m["step"] for m in rerun.history(rank=1)] == [3, 4, 5, 6]
    table = read_metrics(str(tmp_path)).to_pydict()
    rows = sorted(zip(table["rank"], table["step"], table["attempt"]))
    assert [(step, attempt) for rank, step, attempt in rows if rank == 0] == [
        (0, 0), (1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (6, 1)]


def test_the_progress_line_says_resumed_when_the_step_goes_back():
    lines: list[str] = []
    progress = Progress(None, interval_s=3600, phase_keys=False, emit=lines.append)
    for item in _two_attempts():
        progress.observe(item)
    # the first report prints; the long interval prints nothing else, except the restart at once
    assert len(lines) == 2
    assert lines[1].startswith("[rayzero] step 3 (restarted: no checkpoint known, the loop went back to step 3)")
    for item in _reports(0, range(7, 9), 104):
        progress.observe(item)
    assert "resumed" not in progress.line()
    assert progress.rates()["samples_per_s"] > 0  # measured within the new attempt, never negative


def test_the_progress_line_names_the_checkpoint_a_restart_resumed_from():
    lines: list[str] = []
    progress = Progress(None, interval_s=3600, phase_keys=False, emit=lines.append)
    reports = _two_attempts()
    progress.attempt_began(AttemptStart(attempt=0, cause="start", time=0.0, resumed_step=None, workers=2))
    for item in reports[:10]:
        progress.observe(item)
    # the restart resumed from step 2's checkpoint, as the controller began it; the driver's
    # update with the new attempt's first report may already know a newer one (its own)
    progress.attempt_began(AttemptStart(attempt=1, cause="worker died", time=100.0, resumed_step=2, workers=2))
    for item in reports[10:]:
        progress.observe(item)
    assert lines[1].startswith("[rayzero] step 3 (restarted: resumed from the checkpoint of step 2)"), lines
    assert progress.final_line() is not None  # newer reports came after the last line printed


def test_each_restart_line_names_its_own_attempt_s_checkpoint_when_one_poll_brings_two_starts():
    # CI: attempt 2 resumed from step 4, saved at 6 and failed, and attempt 3 began from 6, all within
    # one long poll; the driver hands every start to Progress before that poll's reports
    lines: list[str] = []
    progress = Progress(None, interval_s=3600, phase_keys=False, emit=lines.append)
    progress.attempt_began(AttemptStart(attempt=0, cause="start", time=0.0, resumed_step=None, workers=1))
    for item in _reports(0, range(1, 5), 0):
        progress.observe(item)
    progress.attempt_began(AttemptStart(attempt=1, cause="loop error", time=10.0, resumed_step=2, workers=1))
    progress.attempt_began(AttemptStart(attempt=2, cause="loop error", time=12.0, resumed_step=4, workers=1))
    for item in _reports(0, range(3, 6), 10, attempt=1) + _reports(0, range(5, 8), 12, attempt=2):
        progress.observe(item)
    said = [line.split(" (restarted: ")[1].split(")")[0] for line in lines if "restarted" in line]
    assert said == ["resumed from the checkpoint of step 2", "resumed from the checkpoint of step 4"], lines


def test_the_summary_does_not_repeat_the_last_progress_line():
    lines: list[str] = []
    progress = Progress(None, interval_s=0, phase_keys=False, emit=lines.append)
    progress.observe(Report(rank=0, seq=0, time=1.0, metrics={"step": 1}))
    assert progress.final_line() is None


def test_the_progress_line_says_where_offloaded_state_lives():
    lines: list[str] = []
    progress = Progress(None, interval_s=0, phase_keys=False, emit=lines.append)
    plain = {"device_bytes": 3 << 20, "host_bytes": 0, "nvme_bytes": 0}
    progress.observe(Report(rank=0, seq=0, time=1.0, metrics={"step": 1}, placement=plain))
    assert "state" not in lines[-1]  # nothing offloaded: the line stays short
    offloaded = {"device_bytes": 3 << 20, "host_bytes": 5 << 30, "nvme_bytes": 7 << 30}
    progress.observe(Report(rank=0, seq=1, time=2.0, metrics={"step": 2}, placement=offloaded))
    assert lines[-1].endswith("state r0 device 3MiB host 5.0GiB nvme 7.0GiB"), lines[-1]


def test_a_report_without_a_step_is_not_shown_as_one():
    lines: list[str] = []
    progress = Progress(None, interval_s=0, phase_keys=False, emit=lines.append)
    progress.observe(Report(rank=0, seq=0, time=1.0, metrics={"step": 40, "loss": 1.0}))
    # a loop's first report after a resume may carry no step (elastic_loop's {"loaded_step": ...}):
    # its sequence number is not a step
    progress.observe(Report(rank=0, seq=0, time=2.0, metrics={"loaded_step": 40}))
    assert lines[-1].startswith("[rayzero] report 0 (restarted: no checkpoint known, the loop went back to report 0)")
    progress.observe(Report(rank=0, seq=1, time=3.0, metrics={"step": 41}))
    assert lines[-1].startswith("[rayzero] step 41 |"), lines


class _ScriptedGroup:
    """One attempt's worker group: its polls played back in order (the last one repeats)."""

    def __init__(self, polls: list[GroupPoll]) -> None:
        self.polls = polls

    def start(self) -> dict[str, float]:
        return {}

    def launch(self, train_loop, loop_config) -> None:
        pass

    def poll(self, timeout_s: float) -> GroupPoll:
        return self.polls.pop(0) if len(self.polls) > 1 else self.polls[0]

    def heartbeats(self, timeout_s: float):
        return {}, []

    def shutdown(self, until_free: bool = False) -> None:
        pass


def test_each_line_counts_the_restarts_charged_before_its_own_attempt_when_one_poll_brings_them_all():
    # attempt 0 fails (charged: 1); attempt 1 is preempted (a planned regroup: not charged); attempt 2
    # fails (charged: 2); attempt 3 finishes. The driver polls once, after all of it: the controller's
    # count is then 2, which the line of attempt 1's step 3 used to show ("restarts 2" after one restart)
    crash = Failure(FailureKind.LOOP_ERROR, "loop raised", rank=0)
    scripts = [
        [GroupPoll(reports=_reports(0, range(1, 5), 0)), GroupPoll(failures=[crash])],
        [GroupPoll(reports=_reports(0, range(3, 6), 10, attempt=1)),
         GroupPoll(finished=True, stopped=True, preempted=[0])],
        [GroupPoll(reports=_reports(0, range(5, 7), 20, attempt=2)), GroupPoll(failures=[crash])],
        [GroupPoll(reports=_reports(0, range(6, 9), 30, attempt=3)), GroupPoll(finished=True)],
    ]
    ticks = iter(range(1000, 100_000, 2))
    controller = Controller(lambda attempt, resume, workers: _ScriptedGroup(scripts[attempt]), lambda: None, None,
                            FailurePolicy(max_failures=5, max_failures_without_progress=0),
                            plan=BatchPlan(1, 1, None), clock=lambda: float(next(ticks)))
    while not controller.state.is_terminal:
        controller.step()
    update = controller.take_update()  # the one long poll
    assert update.failures == 2
    assert [(start.attempt, start.cause, start.failures) for start in update.attempts] == [
        (0, "start", 0), (1, "loop error", 1), (2, "preemption", 1), (3, "loop error", 2)]
    lines: list[str] = []
    progress = Progress(None, interval_s=3600, phase_keys=False, emit=lines.append)
    progress.max_failures = 5
    for start in update.attempts:  # as the driver hands them over: every start before the reports
        progress.attempt_began(start)
    for item in update.reports:
        progress.observe(item)
    said = {line.split(" ")[2]: line.rsplit(" | ", 1)[-1] for line in lines}  # first step of each attempt
    assert said == {"1": "mem r0 0B", "3": "restarts 1/5", "5": "restarts 1/5", "6": "restarts 2/5"}, lines
