"""Long runs do not stall (issue 25): the metrics path costs O(1) per report, flushes only new rows,
keeps a bounded window in memory, survives a dead sink, and reads back one row per (rank, step)."""
from __future__ import annotations

import os
import shutil
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayzero.driver.metrics_log import MetricsLog
from rayzero.driver.metrics_store import MetricsHistory, read_metrics, rows_to_table
from rayzero.workers.session import Report

pytestmark = pytest.mark.unit


def _report(rank: int, seq: int, step: int) -> Report:
    # eight keys per row, as the soak run that stalled reported
    return Report(rank=rank, seq=seq, time=1_000.0 + step, peak_memory_bytes=1 << 30, metrics={
        "step": step, "loss": 1.0 / (step + 1), "lr": 1e-3, "samples": 8 * step, "tokens": 1024 * step,
        "grad_norm": 0.5, "epoch": step // 1000, "phase": "train"})


def _rss_bytes() -> int:
    with open("/proc/self/statm") as source:
        return int(source.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _calls(function, *args) -> int:
    """How many Python and C functions `function(*args)` calls: a count, the same on every machine."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        function(*args)
    finally:
        sys.setprofile(None)
    return calls


def test_rows_to_table_is_linear():
    # A count of calls, not a timing (the timed version failed once on CI: 8.8x for 4x the rows, a
    # 6 ms measurement on a loaded 2-core machine); the flush's time against rows is bench/longrun.py's.
    rows = [report_row_dict(step) for step in range(40_000)]
    rows_to_table(rows[:10])  # pyarrow's first call imports modules of its own
    small, large = _calls(rows_to_table, rows[:10_000]), _calls(rows_to_table, rows)
    assert large <= 4 * small + 100, (small, large)  # 4x the rows, 4x the calls (and a constant)
    # the work per row is a few calls per key, not a pass over earlier rows
    assert large < 40_000 * 3 * len(rows[0]), large


def report_row_dict(step: int) -> dict:
    return {"rank": step % 2, "seq": step // 2, "time": 1.0 * step, "step": step // 2, "loss": 0.1,
            "lr": 1e-3, "samples": step, "attempt": 0}


def test_200k_reports_keep_memory_and_flush_time_bounded(tmp_path):
    log = MetricsLog(tmp_path.as_uri(), flush_interval_s=3600, rows_per_part=20_000, max_pending_rows=1_000_000)
    rss_at: dict[int, int] = {}
    rows = 0
    for step in range(100_000):
        for rank in (0, 1):
            log.add(_report(rank, step, step))
            rows += 1
        if rows % 20_000 == 0:
            assert log.flush(timeout_s=120), "the writer did not keep up"  # as a real run's pace lets it
            if rows in (40_000, 200_000):
                rss_at[rows] = _rss_bytes()
    log.close()
    assert log.rows_written == 200_000 and log.dropped == 0
    assert log.parts_written == 10  # each flush wrote only its new rows
    # every flush wrote its 20,000 new rows and nothing before them (the quadratic version rewrote
    # every row so far at each flush: ~100 s at 200,000 rows); the flush's time against rows is
    # bench/longrun.py's, not a test's
    assert [(flush["rows_before"], flush["rows"]) for flush in log.flush_log] == [
        (before, 20_000) for before in range(0, 200_000, 20_000)], list(log.flush_log)
    # nothing of the run is kept in the driver: 160,000 more rows (~450 MB when every row was kept)
    assert rss_at[200_000] - rss_at[40_000] < 64 << 20, rss_at
    table = read_metrics(str(tmp_path), columns=["step", "loss"])
    assert table.num_rows == 200_000
    history = log.history()
    assert len(history) == 100_000 and history[-1]["step"] == 99_999 and history[0]["phase"] == "train"


def test_a_dead_sink_costs_metrics_never_waits_and_says_so(tmp_path):
    lines: list[str] = []
    log = MetricsLog(tmp_path.as_uri(), flush_interval_s=0.05, rows_per_part=10, max_pending_rows=50,
                     emit=lines.append)
    for step in range(5):
        log.add(_report(0, step, step))
    assert log.flush(timeout_s=30)
    directory = tmp_path / "metrics.parquet"
    shutil.move(directory, tmp_path / "aside")
    directory.write_text("storage is down: a file where the directory was")
    for step in range(5, 200):  # the sink is dead: add() only queues, and drops past the bound
        log.add(_report(0, step, step))
    deadline = time.monotonic() + 30
    while not any("cannot write" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("cannot write" in line and "training goes on" in line for line in lines), lines
    assert log.dropped >= 200 - 5 - 50
    directory.unlink()
    os.rename(tmp_path / "aside", directory)  # storage is back (fails rather than nest if the writer made a directory)
    assert log.flush(timeout_s=30)
    log.close()
    assert any("works again" in line for line in lines), lines
    assert any(f"{log.dropped} row(s) were dropped" in line for line in lines), lines
    steps = read_metrics(str(tmp_path)).column("step").to_pylist()
    assert steps[:5] == [0, 1, 2, 3, 4] and len(steps) == 200 - log.dropped


def test_parts_with_different_columns_read_as_one_table(tmp_path):
    log = MetricsLog(tmp_path.as_uri(), flush_interval_s=3600)
    log.add(Report(0, 0, 1.0, {"step": 0, "loss": 1, "note": "a"}))
    log.flush()
    log.add(Report(0, 1, 2.0, {"step": 1, "loss": 0.5, "note": 7, "lr": 0.1, "ids": [1, 2]}))
    log.close()
    table = read_metrics(str(tmp_path))
    assert table.column("loss").to_pylist() == [1.0, 0.5]  # an int column that later held floats
    assert table.column("note").to_pylist() == ["a", "7"]  # kinds that disagree: text
    assert table.column("lr").to_pylist() == [None, 0.1]  # a key reported only later
    assert list(log.history()) == [{"step": 0, "loss": 1.0, "note": "a"},
                                   {"step": 1, "loss": 0.5, "note": "7", "lr": 0.1, "ids": [1, 2]}]


def test_a_loop_metric_named_like_a_runtime_column_keeps_its_value(tmp_path):
    log = MetricsLog(tmp_path.as_uri())
    log.add(Report(1, 0, 1.0, {"step": 0, "rank": "mine", "attempt": 9, "metric_x": 3}))
    log.close()
    row = read_metrics(str(tmp_path)).to_pylist()[0]
    assert row["rank"] == 1 and row["attempt"] == 0  # the runtime's columns
    assert list(log.history(rank=1)) == [{"step": 0, "rank": "mine", "attempt": 9, "metric_x": 3}]


def test_a_run_written_as_one_file_is_continued(tmp_path):
    # what an earlier rayzero left: metrics.parquet as one file, attempts 0 and 1
    pq.write_table(pa.table({"rank": [0, 0, 0], "seq": [0, 1, 0], "time": [1.0, 2.0, 3.0], "step": [0, 1, 1],
                             "attempt": [0, 0, 1], "loss": [3.0, 2.0, 1.9]}), tmp_path / "metrics.parquet")
    assert read_metrics(str(tmp_path)).column("loss").to_pylist() == [3.0, 1.9]  # readable as it is
    rerun = MetricsLog(tmp_path.as_uri())
    assert rerun.first_attempt == 2
    rerun.add(Report(0, 0, 4.0, {"step": 1, "loss": 1.5}))
    rerun.add(Report(0, 1, 5.0, {"step": 2, "loss": 1.0}))
    rerun.close()
    table = read_metrics(str(tmp_path))
    assert table.column("step").to_pylist() == [0, 1, 2]
    assert table.column("loss").to_pylist() == [3.0, 1.5, 1.0]
    assert table.column("attempt").to_pylist() == [0, 2, 2]
    assert [m["step"] for m in MetricsHistory(str(tmp_path), 0, rerun.first_attempt)] == [1, 2]


def test_goodput_rows_live_beside_the_reports_but_a_table_of_reports_holds_only_reports(tmp_path):
    log = MetricsLog(tmp_path.as_uri(), flush_interval_s=0.05, emit=lambda line: None)
    for step in range(3):
        log.add(Report(rank=0, seq=step, time=1.0 + step, peak_memory_bytes=0,
                       metrics={"step": step, "kind": "train", "goodput_cause": "mine"}))
    log.goodput_rows({"attempts": {"0": {"productive": 9.5, "restart": 0.5}}})
    assert log.flush(timeout_s=30)
    log.close()
    reports = read_metrics(str(tmp_path))
    assert reports.column("step").to_pylist() == [0, 1, 2]
    assert reports.column("kind").to_pylist() == ["train"] * 3  # a loop's own `kind` is its own
    assert reports.column("metric_goodput_cause").to_pylist() == ["mine"] * 3  # a runtime name, prefixed
    assert "goodput_seconds" not in reports.column_names
    goodput = read_metrics(str(tmp_path), goodput=True).to_pylist()
    assert sorted((row["attempt"], row["goodput_cause"], row["goodput_seconds"]) for row in goodput) == [
        (0, "productive", 9.5), (0, "restart", 0.5)]
    assert read_metrics(str(tmp_path), columns=["step"]).column_names[:1] == ["step"]


def test_queued_rows_wait_as_arrow_tables_not_python_objects(tmp_path):
    """[Note: rows wait as Arrow columns] (issue 35): a flush interval's rows held as dicts of Python
    objects and freed at once left Python's allocator with arenas it could not give back; the driver
    crept ~2.4 MiB per 100,000 steps. The writer now turns every chunk of queued rows into an Arrow
    table before the part is due, so what waits is pyarrow's buffers (not traced by tracemalloc), and
    Python objects for at most a chunk of rows."""
    import tracemalloc

    log = MetricsLog(tmp_path.as_uri(), flush_interval_s=3600, rows_per_part=1_000_000, max_pending_rows=1_000_000)
    log.add(_report(0, 0, 0))  # the writer thread and pyarrow's first use
    assert log.flush(timeout_s=60)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for step in range(1, 40_001):  # 40,000 rows queued, no part due for an hour
            log.add(_report(step % 2, step, step))
        deadline = time.monotonic() + 60
        while tracemalloc.get_traced_memory()[0] - before > 8 << 20 and time.monotonic() < deadline:
            time.sleep(0.1)  # the writer turns the chunks into tables meanwhile
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # as rows: ~40 MB of dicts and values (1 kB a row); as tables, at most a chunk of rows is left
    assert held < 8 << 20, f"{held / 2**20:.1f} MiB of Python objects for 40,000 queued rows"
    assert log.rows_written == 1  # nothing written meanwhile: the rows wait, as Arrow tables
    assert log.flush(timeout_s=120) and log.rows_written == 40_001
    log.close()
    assert read_metrics(str(tmp_path), columns=["step"]).column("step").to_pylist() == list(range(40_001))


def test_the_flush_log_keeps_the_newest_flushes_outside_pythons_small_object_allocator():
    """[Note: the driver's long-lived objects]: a flush record kept as Python objects, made among a
    burst of rows, pins an arena of Python's allocator for the run; the log keeps doubles in one buffer."""
    from rayzero.driver.metrics_log import FlushLog

    log = FlushLog(capacity=100)
    assert len(log) == 0 and list(log) == []
    for flush in range(10):
        log.append(1000 * flush, 1000, 0.5 + flush)
    assert len(log) == 10 and log[0] == {"rows_before": 0, "rows": 1000, "seconds": 0.5}
    assert log[-1] == {"rows_before": 9000, "rows": 1000, "seconds": 9.5}
    for flush in range(10, 250):  # past the capacity: the newest 100 are kept, oldest first
        log.append(1000 * flush, 1000, 0.5 + flush)
    assert len(log) == 100
    assert [record["rows_before"] for record in log] == [1000.0 * flush for flush in range(150, 250)]
    assert log[0]["seconds"] == 150.5 and log[-100] == log[0] and log[99] == log[-1]
    with pytest.raises(IndexError):
        log[100]
    blocks = sys.getallocatedblocks()
    for flush in range(250, 5250):
        log.append(1000 * flush, 1000, 0.5 + flush)
    # a dict of three floats per flush (the log before) kept ~5 blocks each: +25,000 here
    assert sys.getallocatedblocks() - blocks < 100
